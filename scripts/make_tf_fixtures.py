"""Write the TensorFlow ground truth that tests/optim/test_tf_parity.py checks the optimizers against.

Run with an interpreter that has TensorFlow (no torch needed)::

    python scripts/make_tf_fixtures.py [--out tests/fixtures/optim]

Every case drives ``tf.compat.v1.train.<Name>Optimizer`` in graph mode on two
resource variables, ``var0`` (4, 3) and ``var1`` (5,), for five steps of
``apply_gradients(..., global_step=gs)`` with gradients fed through placeholders:
dense tensors, or ``IndexedSlices`` whose indices repeat (TF sums duplicates before
the update; GradientDescent applies them one after another): a few rows a step
(``sparse``), or 24 (``repeats``), where a row given three times or more holds a
large value and, later, its negation, so that the sum of the values in between keeps
the roundings of TF's order of addition. A case is one optimizer configuration ×
dense|sparse|repeats × float32|float64.

Output, all deterministic (seeded inputs, one thread):

- ``manifest.json``: one entry per case (id, optimizer class, constructor kwargs
  under this project's argument names, dtype, gradient kind, steps, variable
  shapes, slot names, non-slot names, TensorFlow version, npz file);
- ``<Name>.npz``, one per optimizer, with the arrays of each case under
  ``<case id>/<array>``: ``var{i}/init``; ``var{i}/steps`` (row k-1: after step
  k); the gradients, ``grad{i}`` (dense, row k-1: step k) or the rows of every
  step in order as ``grad{i}/indices``, ``grad{i}/values`` and ``grad{i}/step``
  (the step, from 1, each row belongs to); ``slot{i}/<slot name>`` after the
  last step (``get_slot``) and ``non_slot/<name>`` (Adam's beta powers).
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

# Quiet TF's start-up logging, and keep oneDNN rewrites out of the numbers.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

STEPS = 5
SHAPES = {"var0": (4, 3), "var1": (5,)}
DTYPES = ("float32", "float64")
KINDS = ("dense", "sparse", "repeats")
# Entries per step of the "repeats" gradients: more than torch's coalesce() keeps in order (16).
REPEATS = 24

# Row indices of the sparse gradients, per step. Every step repeats an index
# (TF sums duplicates first) and leaves some rows untouched (the lazy rules
# must not move them).
SPARSE_INDICES = {
    "var0": ([0, 2, 0, 3], [1, 1, 3], [2, 0, 2, 2], [3, 1, 0, 3], [0, 0]),
    "var1": ([1, 4, 1], [0, 3, 3, 2], [4, 4], [2, 0, 2, 1], [3, 1, 3]),
}

# (optimizer, config name, constructor kwargs). The config name says which
# arguments that change the math it moves away from their defaults; learning
# rates are large enough that every step moves the variables well beyond the
# test tolerances.
CONFIGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("GradientDescent", "lr", {"learning_rate": 0.1}),
    ("Momentum", "momentum", {"learning_rate": 0.05, "momentum": 0.9}),
    ("Momentum", "nesterov", {"learning_rate": 0.05, "momentum": 0.7, "use_nesterov": True}),
    ("Adagrad", "default", {"learning_rate": 0.1}),
    ("Adagrad", "init", {"learning_rate": 0.1, "initial_accumulator_value": 0.5}),
    ("AdagradDA", "init", {"learning_rate": 0.1, "initial_gradient_squared_accumulator_value": 0.5}),
    ("AdagradDA", "l1", {"learning_rate": 0.1, "l1_regularization_strength": 0.3}),
    ("AdagradDA", "l2", {"learning_rate": 0.1, "l2_regularization_strength": 0.5}),
    (
        "AdagradDA",
        "l1l2",
        {"learning_rate": 0.1, "l1_regularization_strength": 0.3, "l2_regularization_strength": 0.5},
    ),
    ("Adam", "default", {"learning_rate": 0.1}),
    ("Adam", "beta1", {"learning_rate": 0.1, "beta1": 0.5}),
    ("Adam", "beta2", {"learning_rate": 0.1, "beta2": 0.9}),
    ("Adam", "eps1", {"learning_rate": 0.1, "epsilon": 1.0}),
    # With the default epsilon (1e-8) an Adadelta step is about 1e-4 * learning_rate,
    # so a large learning rate keeps the steps well above the float32 tolerance.
    ("Adadelta", "lr", {"learning_rate": 100.0}),
    ("Adadelta", "rho", {"learning_rate": 1.0, "rho": 0.5, "epsilon": 1e-4}),
    ("Adadelta", "epsilon", {"learning_rate": 1.0, "epsilon": 0.1}),
    ("RMSProp", "decay", {"learning_rate": 0.1, "decay": 0.5}),
    ("RMSProp", "momentum", {"learning_rate": 0.1, "momentum": 0.9}),
    ("RMSProp", "epsilon", {"learning_rate": 0.1, "epsilon": 0.1}),
    ("RMSProp", "centered", {"learning_rate": 0.1, "centered": True}),
    ("RMSProp", "centered_momentum", {"learning_rate": 0.1, "momentum": 0.5, "centered": True}),
    ("Ftrl", "default", {"learning_rate": 0.5}),
    ("Ftrl", "power0.3", {"learning_rate": 0.5, "learning_rate_power": -0.3}),
    ("Ftrl", "power0", {"learning_rate": 0.5, "learning_rate_power": 0.0}),
    ("Ftrl", "init", {"learning_rate": 0.5, "initial_accumulator_value": 0.5}),
    ("Ftrl", "l1", {"learning_rate": 0.5, "l1_regularization_strength": 1.0}),
    ("Ftrl", "l2", {"learning_rate": 0.5, "l2_regularization_strength": 0.5}),
    ("Ftrl", "shrinkage", {"learning_rate": 0.5, "l2_shrinkage_regularization_strength": 0.2}),
    ("Ftrl", "beta", {"learning_rate": 0.5, "beta": 0.5}),
    ("ProximalAdagrad", "init", {"learning_rate": 0.1, "initial_accumulator_value": 0.5}),
    ("ProximalAdagrad", "l1", {"learning_rate": 0.1, "l1_regularization_strength": 2.0}),
    ("ProximalAdagrad", "l2", {"learning_rate": 0.1, "l2_regularization_strength": 1.0}),
    (
        "ProximalAdagrad",
        "l1l2",
        {"learning_rate": 0.1, "l1_regularization_strength": 2.0, "l2_regularization_strength": 1.0},
    ),
    ("ProximalGradientDescent", "l1", {"learning_rate": 0.1, "l1_regularization_strength": 2.0}),
    ("ProximalGradientDescent", "l2", {"learning_rate": 0.1, "l2_regularization_strength": 1.0}),
    (
        "ProximalGradientDescent",
        "l1l2",
        {"learning_rate": 0.1, "l1_regularization_strength": 2.0, "l2_regularization_strength": 1.0},
    ),
)


def make_inputs(seed_name: str, kind: str) -> dict[str, np.ndarray]:
    """Initial values and the gradients of every step in float64, seeded by ``seed_name``.

    Both dtypes of a configuration share these inputs (float32 rounds them).
    """
    rng = np.random.default_rng(zlib.crc32(seed_name.encode()))
    arrays: dict[str, np.ndarray] = {}
    for i, (var, shape) in enumerate(SHAPES.items()):
        arrays[f"var{i}/init"] = rng.standard_normal(shape)
        if kind == "dense":
            arrays[f"grad{i}"] = rng.standard_normal((STEPS, *shape))
        elif kind == "repeats":
            rows = rng.integers(0, shape[0], (STEPS, REPEATS))
            values = rng.standard_normal((STEPS, REPEATS, *shape[1:]))
            for k in range(STEPS):
                for row in np.unique(rows[k]):
                    at = np.flatnonzero(rows[k] == row)
                    if len(at) >= 3:
                        values[k, at[0]] *= 2.0**20
                        values[k, at[-1]] = -values[k, at[0]]
            arrays[f"grad{i}/indices"] = rows.reshape(-1)
            arrays[f"grad{i}/step"] = np.repeat(np.arange(1, STEPS + 1), REPEATS)
            arrays[f"grad{i}/values"] = values.reshape(-1, *shape[1:])
        else:
            rows = SPARSE_INDICES[var]
            arrays[f"grad{i}/indices"] = np.concatenate(rows).astype(np.int64)
            arrays[f"grad{i}/step"] = np.repeat(np.arange(1, STEPS + 1), [len(r) for r in rows])
            arrays[f"grad{i}/values"] = rng.standard_normal((sum(map(len, rows)), *shape[1:]))
    return arrays


def step_gradient(arrays: dict[str, np.ndarray], i: int, k: int) -> dict[str, np.ndarray]:
    """The gradient of ``var{i}`` at step ``k`` (1-based): ``dense``, or ``indices`` and ``values``."""
    if f"grad{i}" in arrays:
        return {"dense": arrays[f"grad{i}"][k - 1]}
    rows = arrays[f"grad{i}/step"] == k
    return {"indices": arrays[f"grad{i}/indices"][rows], "values": arrays[f"grad{i}/values"][rows]}


# TF's dense ProximalAdagrad and ProximalGradientDescent pass their float32
# hyperparameter tensors to the kernel without casting, which rejects float64
# variables. For float64 they get float64 tensors holding the float32-rounded
# values: the numbers their sparse path (which casts) and every other optimizer use.
UNCAST_HYPERPARAMETERS = ("ProximalAdagrad", "ProximalGradientDescent")


def build_optimizer(name: str, kwargs: dict[str, Any], dtype: str, global_step: tf.Variable) -> Any:
    cls = getattr(tf.compat.v1.train, f"{name}Optimizer")
    if name in UNCAST_HYPERPARAMETERS and dtype == "float64":
        kwargs = dict(kwargs)
        for key in ("learning_rate", "l1_regularization_strength", "l2_regularization_strength"):
            kwargs[key] = tf.cast(tf.constant(kwargs.get(key, 0.0), tf.float32), tf.float64)
    if name == "AdagradDA":
        # TF's AdagradDA reads T = global_step + 1; the torch port keeps its own counter.
        return cls(global_step=global_step, **kwargs)
    return cls(**kwargs)


def run_case(
    name: str, kwargs: dict[str, Any], kind: str, dtype: str, inputs: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """Drive one case through TF; return its arrays, slot names and non-slot names."""
    arrays = {key: value.astype(dtype) if value.dtype.kind == "f" else value for key, value in inputs.items()}
    graph = tf.Graph()
    with graph.as_default():
        global_step = tf.compat.v1.train.get_or_create_global_step()
        variables = []
        placeholders = []
        grads_and_vars = []
        for i, (var, shape) in enumerate(SHAPES.items()):
            variable = tf.compat.v1.get_variable(var, initializer=arrays[f"var{i}/init"], use_resource=True)
            if kind == "dense":
                feed = {"dense": tf.compat.v1.placeholder(dtype, shape)}
                grad = feed["dense"]
            else:
                feed = {
                    "indices": tf.compat.v1.placeholder(tf.int64, [None]),
                    "values": tf.compat.v1.placeholder(dtype, [None, *shape[1:]]),
                }
                grad = tf.IndexedSlices(feed["values"], feed["indices"], tf.constant(shape, tf.int64))
            variables.append(variable)
            placeholders.append(feed)
            grads_and_vars.append((grad, variable))
        opt = build_optimizer(name, kwargs, dtype, global_step)
        train_op = opt.apply_gradients(grads_and_vars, global_step=global_step)
        slot_names = opt.get_slot_names()
        slots = {f"slot{i}/{s}": opt.get_slot(v, s) for i, v in enumerate(variables) for s in slot_names}
        non_slot = {f"non_slot/{key[0]}": v for key, v in sorted(opt._non_slot_dict.items())}
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
        trajectories: list[list[np.ndarray]] = [[] for _ in variables]
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for k in range(1, STEPS + 1):
                feed_dict = {}
                for i, feed in enumerate(placeholders):
                    for part, value in step_gradient(arrays, i, k).items():
                        feed_dict[feed[part]] = value
                sess.run(train_op, feed_dict=feed_dict)
                for trajectory, value in zip(trajectories, sess.run(variables), strict=True):
                    trajectory.append(value)
            if sess.run(global_step) != STEPS:
                raise RuntimeError(f"{name}: global_step did not advance once per apply_gradients")
            arrays.update(sess.run({**slots, **non_slot}))
    for i, trajectory in enumerate(trajectories):
        arrays[f"var{i}/steps"] = np.stack(trajectory)
    return arrays, slot_names, sorted(key.split("/", 1)[1] for key in non_slot)


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    manifest: list[dict[str, Any]] = []
    per_file: dict[str, dict[str, np.ndarray]] = {}
    for name, config, kwargs in CONFIGS:
        for kind in KINDS:
            inputs = make_inputs(f"{name}-{config}-{kind}", kind)
            for dtype in DTYPES:
                case_id = f"{name}-{config}-{kind}-{dtype}"
                arrays, slot_names, non_slot_names = run_case(name, kwargs, kind, dtype, inputs)
                file = f"{name}.npz"
                per_file.setdefault(file, {}).update({f"{case_id}/{k}": v for k, v in arrays.items()})
                manifest.append(
                    {
                        "id": case_id,
                        "optimizer": f"{name}Optimizer",
                        "config": config,
                        "kwargs": kwargs,
                        "dtype": dtype,
                        "grad": kind,
                        "steps": STEPS,
                        "shapes": {var: list(shape) for var, shape in SHAPES.items()},
                        "slots": slot_names,
                        "non_slots": non_slot_names,
                        "tf_version": tf.__version__,
                        "file": file,
                    }
                )
    for file, arrays in per_file.items():
        np.savez_compressed(out / file, **arrays)
    # One case per line: compact, and a regenerated manifest diffs case by case.
    lines = ",\n".join(json.dumps(entry) for entry in manifest)
    (out / "manifest.json").write_text(f"[\n{lines}\n]\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/optim"), help="output folder")
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    generate(args.out)


if __name__ == "__main__":
    main()
