"""Write the TF reference values that tests/amp/test_loss_scale*.py check torchgrad_compat.amp against.

Run with an interpreter that has TensorFlow (no torch needed)::

    TF_CPP_MIN_LOG_LEVEL=2 /work/tfvenv/bin/python scripts/make_tf_loss_scale_fixtures.py

Everything runs in graph mode on one thread, with Grappler off (see
``_config``), and writes two JSON files under
``tests/fixtures/amp/`` (``Infinity``/``NaN`` are written as Python's json does):

- ``tf_loss_scale.json``: ``tf.compat.v1.mixed_precision.DynamicLossScale`` and
  ``FixedLossScale`` driven through sequences of ``update(grads)`` calls. A step
  is a list of gradient tokens (see ``GRAD_TOKENS``: finite, NaN, ±inf, None,
  ``IndexedSlices``); after every update the case records the scale, the
  good-step counter and ``should_apply_gradients``. The cases cover growth,
  backoff, the floor of 1 (which also raises a scale below 1), the counter
  reset on a non-finite step, growth that would overflow float32, and
  multipliers whose float32 rounding matters (3, 1.1).
- ``tf_loss_scale_optimizer.json``: ``MixedPrecisionLossScaleOptimizer`` around
  GradientDescent, Momentum, Adam (dense and sparse) and AdagradDA, each step a
  ``minimize(loss, global_step)`` of ``loss = Σ var0·t0 + Σ var1·t1`` (the
  gradient of ``var_i`` is ``t_i``; a sparse ``var0`` is read through
  ``tf.gather`` with repeated rows), with inf, -inf, NaN and a finite value that
  overflows once multiplied by the scale injected into ``t`` at chosen steps.
  After every step it records the variables, every slot, the non-slot state
  (Adam's beta powers), ``global_step``, the scale and the good-step counter.
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

tf1 = tf.compat.v1
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "amp"

# A gradient token names one gradient passed to update(): a float32 vector
# [1, -2, 0.5] whose middle element is replaced, None, or an IndexedSlices whose
# values are [[1, -2], [0.5, x]] at rows [0, 2] of a (3, 2) variable.
GRAD_TOKENS = {
    "finite": 3.0,
    "huge": 3e38,  # finite: large unscaled gradients are applied
    "inf": np.inf,
    "-inf": -np.inf,
    "nan": np.nan,
    "sparse": 3.0,
    "sparse-inf": np.inf,
    "sparse-nan": np.nan,
}

F, INF, NAN = "finite", "inf", "nan"

# (id, class, constructor kwargs, steps). A step is a list of gradient tokens or None.
SEQUENCES: tuple[tuple[str, str, dict[str, Any], list[list[str | None]]], ...] = (
    ("grow", "Dynamic", {"initial_loss_scale": 1, "increment_period": 2}, [[F]] * 6),
    ("backoff", "Dynamic", {"initial_loss_scale": 1024, "increment_period": 2}, [[NAN]] * 6),
    ("floor", "Dynamic", {"initial_loss_scale": 16, "increment_period": 2}, [[INF]] * 6),
    (
        "floor-raises-below-one",
        "Dynamic",
        {"initial_loss_scale": 0.5, "increment_period": 2},
        [[NAN], [F], [F], [NAN], [F]],
    ),
    (
        "nonfinite-resets-counter",
        "Dynamic",
        {"initial_loss_scale": 1, "increment_period": 2},
        [[F], [F], [F], [NAN], [F]],
    ),
    (
        "counter-reset-mid-period",
        "Dynamic",
        {"initial_loss_scale": 4, "increment_period": 5},
        [[F], [F], [F], [F], ["-inf"], [F], [F], [F], [F], [F], [F]],
    ),
    (
        "period-1",
        "Dynamic",
        {"initial_loss_scale": 1, "increment_period": 1},
        [[F], [F], [F], [NAN], [F], [F]],
    ),
    (
        "multiplier-3",
        "Dynamic",
        {"initial_loss_scale": 4, "increment_period": 2, "multiplier": 3.0},
        [[F], [F], [NAN], [F], [F]],
    ),
    (
        "multiplier-3-inexact",
        "Dynamic",
        {"initial_loss_scale": 10, "increment_period": 1, "multiplier": 3.0},
        [[NAN], [NAN], [F], [NAN], [NAN], [NAN], [F]],
    ),
    (
        "multiplier-1.1",
        "Dynamic",
        {"initial_loss_scale": 1000, "increment_period": 1, "multiplier": 1.1},
        [[F], [F], [F], [INF], [F], [NAN], [NAN]],
    ),
    (
        "cap-power-of-two",
        "Dynamic",
        {"initial_loss_scale": 2.0**125, "increment_period": 1},
        [[F]] * 5,
    ),
    (
        "cap-inexact",
        "Dynamic",
        {"initial_loss_scale": 3e38, "increment_period": 2, "multiplier": 1.1},
        [[F]] * 6 + [[NAN], [F], [F]],
    ),
    (
        "mix",
        "Dynamic",
        {"initial_loss_scale": 8, "increment_period": 3},
        [
            [F, None],
            [F, "sparse"],
            [F, F],
            [None, "sparse-inf"],
            [F, "huge"],
            ["-inf", F],
            [F, None, "sparse"],
            [F],
            [F, F],
            ["sparse-nan"],
            [F, "sparse"],
        ],
    ),
    ("none-only", "Dynamic", {"initial_loss_scale": 2, "increment_period": 2}, [[None], [None], [None]]),
    ("defaults", "Dynamic", {}, [[F], [NAN], [F], [INF]]),
    ("fixed", "Fixed", {"loss_scale_value": 128}, [[F], [NAN], [INF, "sparse-nan"], [F]]),
)


def make_grad(token: str | None) -> Any:
    if token is None:
        return None
    x = GRAD_TOKENS[token]
    if token.startswith("sparse"):
        values = tf.constant([[1.0, -2.0], [0.5, x]], tf.float32)
        return tf.IndexedSlices(values, tf.constant([0, 2], tf.int64), tf.constant([3, 2], tf.int64))
    return tf.constant([1.0, x, 0.5], tf.float32)


def run_sequence(cls: str, kwargs: dict[str, Any], steps: list[list[str | None]]) -> dict[str, Any]:
    graph = tf.Graph()
    with graph.as_default():
        loss_scale = getattr(tf1.mixed_precision, f"{cls}LossScale")(**kwargs)
        updates = [loss_scale.update([make_grad(t) for t in step]) for step in steps]
        scale = loss_scale()
        good_steps = getattr(loss_scale, "_num_good_steps", None)
        with tf1.Session(graph=graph, config=_config()) as sess:
            sess.run(tf1.global_variables_initializer())
            initial = float(sess.run(scale))
            trace = []
            for update_op, should_apply in updates:
                if isinstance(should_apply, bool):  # FixedLossScale: a Python True
                    sess.run(update_op)
                    applied = should_apply
                else:
                    _, applied = sess.run([update_op, should_apply])
                entry = {"scale": float(sess.run(scale)), "should_apply": bool(applied)}
                if good_steps is not None:
                    entry["good_steps"] = int(sess.run(good_steps))
                trace.append(entry)
        config = loss_scale.get_config()
    return {"initial_scale": initial, "trace": trace, "get_config": config}


# --------------------------------------------------------------------------- optimizer trajectories
STEPS = 10
SHAPES = {"var0": (4, 3), "var1": (5,)}
SPARSE_ROWS = [0, 2, 0]  # rows of var0 gathered each step in the sparse cases (row 0 twice)
# step (1-based) -> (variable index, element, injected value). The value 1e38 is
# finite but overflows float32 once the loss (and so the gradient) is multiplied
# by the scale, so TF sees inf in the unscaled gradient too.
INJECTIONS = {2: (0, 1, np.inf), 5: (1, 3, np.nan), 7: (0, 0, 1e38), 8: (1, 0, -np.inf)}
DYNAMIC = {"initial_loss_scale": 8, "increment_period": 2}

# (id, optimizer, kwargs, loss scale class, loss scale kwargs, var0 gradient kind)
TRAJECTORIES: tuple[tuple[str, str, dict[str, Any], str, dict[str, Any], str], ...] = (
    ("GradientDescent-dynamic", "GradientDescent", {"learning_rate": 0.1}, "Dynamic", DYNAMIC, "dense"),
    (
        "Momentum-dynamic",
        "Momentum",
        {"learning_rate": 0.05, "momentum": 0.9},
        "Dynamic",
        DYNAMIC,
        "dense",
    ),
    ("Adam-dynamic", "Adam", {"learning_rate": 0.1}, "Dynamic", DYNAMIC, "dense"),
    ("Adam-dynamic-sparse", "Adam", {"learning_rate": 0.1}, "Dynamic", DYNAMIC, "sparse"),
    ("AdagradDA-dynamic", "AdagradDA", {"learning_rate": 0.1}, "Dynamic", DYNAMIC, "dense"),
    # A fixed scale never skips: TF applies the non-finite gradients.
    (
        "GradientDescent-fixed",
        "GradientDescent",
        {"learning_rate": 0.1},
        "Fixed",
        {"loss_scale_value": 4},
        "dense",
    ),
)


def make_targets(case_id: str, kind: str) -> dict[str, np.ndarray]:
    """Initial values and per-step gradient targets (float32), with the injections applied."""
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    arrays: dict[str, np.ndarray] = {}
    for i, shape in enumerate(SHAPES.values()):
        arrays[f"var{i}/init"] = rng.standard_normal(shape).astype(np.float32)
        target_shape = (len(SPARSE_ROWS), shape[1]) if (i == 0 and kind == "sparse") else shape
        arrays[f"target{i}"] = rng.standard_normal((STEPS, *target_shape)).astype(np.float32)
    for k, (i, element, value) in INJECTIONS.items():
        arrays[f"target{i}"][k - 1].reshape(-1)[element] = value
    return arrays


def build_optimizer(name: str, kwargs: dict[str, Any], global_step: Any) -> Any:
    cls = getattr(tf1.train, f"{name}Optimizer")
    return cls(global_step=global_step, **kwargs) if name == "AdagradDA" else cls(**kwargs)


def run_trajectory(
    name: str, kwargs: dict[str, Any], scale_cls: str, scale_kwargs: dict[str, Any], kind: str, case_id: str
) -> dict[str, Any]:
    arrays = make_targets(case_id, kind)
    graph = tf.Graph()
    with graph.as_default():
        global_step = tf1.train.get_or_create_global_step()
        variables = [
            tf1.get_variable(var, initializer=arrays[f"var{i}/init"], use_resource=True)
            for i, var in enumerate(SHAPES)
        ]
        targets = [tf1.placeholder(tf.float32, arrays[f"target{i}"].shape[1:]) for i in range(len(SHAPES))]
        read0 = tf.gather(variables[0], SPARSE_ROWS) if kind == "sparse" else variables[0]
        loss = tf.reduce_sum(read0 * targets[0]) + tf.reduce_sum(variables[1] * targets[1])
        inner = build_optimizer(name, kwargs, global_step)
        loss_scale = getattr(tf1.mixed_precision, f"{scale_cls}LossScale")(**scale_kwargs)
        opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(inner, loss_scale)
        train_op = opt.minimize(loss, global_step=global_step)
        slot_names = inner.get_slot_names()
        watched = {f"var{i}": v for i, v in enumerate(variables)}
        watched.update(
            {f"slot{i}/{s}": inner.get_slot(v, s) for i, v in enumerate(variables) for s in slot_names}
        )
        watched.update({f"non_slot/{key[0]}": v for key, v in sorted(inner._non_slot_dict.items())})
        watched["global_step"] = global_step
        watched["scale"] = loss_scale()
        if scale_cls == "Dynamic":
            watched["good_steps"] = loss_scale._num_good_steps
        steps: dict[str, list[Any]] = {key: [] for key in watched}
        with tf1.Session(graph=graph, config=_config()) as sess:
            sess.run(tf1.global_variables_initializer())
            for k in range(STEPS):
                feed = {t: arrays[f"target{i}"][k] for i, t in enumerate(targets)}
                sess.run(train_op, feed_dict=feed)
                for key, value in sess.run(watched).items():
                    steps[key].append(value.tolist())
    return {
        "init": [arrays[f"var{i}/init"].tolist() for i in range(len(SHAPES))],
        "targets": [arrays[f"target{i}"].tolist() for i in range(len(SHAPES))],
        "slots": slot_names,
        "non_slots": sorted(key.split("/", 1)[1] for key in watched if key.startswith("non_slot/")),
        "steps": steps,
    }


def _config() -> Any:
    config = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    # Grappler's constant folding rewrites the backoff ``scale / multiplier`` into
    # ``scale * (1 / multiplier)``, one float32 ulp away when the multiplier is not a
    # power of two (10 / 3 gives 3.3333335, not 3.3333333). Eager TF and loss_scale.py's
    # source divide; the fixtures record that rule.
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sequences = [
        {"id": case_id, "class": f"{cls}LossScale", "kwargs": kwargs, "steps": steps}
        | run_sequence(cls, kwargs, steps)
        for case_id, cls, kwargs, steps in SEQUENCES
    ]
    _write(out / "tf_loss_scale.json", {"tf_version": tf.__version__, "cases": sequences})
    trajectories = [
        {
            "id": case_id,
            "optimizer": f"{name}Optimizer",
            "kwargs": kwargs,
            "loss_scale": {"class": f"{scale_cls}LossScale", "kwargs": scale_kwargs},
            "var0_grad": kind,
            "sparse_rows": SPARSE_ROWS,
            "injections": {str(k): [i, element, value] for k, (i, element, value) in INJECTIONS.items()},
        }
        | run_trajectory(name, kwargs, scale_cls, scale_kwargs, kind, case_id)
        for case_id, name, kwargs, scale_cls, scale_kwargs, kind in TRAJECTORIES
    ]
    _write(out / "tf_loss_scale_optimizer.json", {"tf_version": tf.__version__, "cases": trajectories})


def _write(path: Path, data: dict[str, Any]) -> None:
    # One case per line: a regenerated file diffs case by case.
    cases = ",\n".join(json.dumps(case) for case in data["cases"])
    path.write_text(f'{{"tf_version": {json.dumps(data["tf_version"])}, "cases": [\n{cases}\n]}}\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="output folder")
    args = parser.parse_args()
    tf1.disable_eager_execution()
    generate(args.out)


if __name__ == "__main__":
    main()
