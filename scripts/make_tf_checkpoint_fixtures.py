"""Write the TF checkpoints and continued runs that tests/checkpoint/test_tf_checkpoint.py checks against.

Run with an interpreter that has TensorFlow (no torch needed)::

    python scripts/make_tf_checkpoint_fixtures.py [--out tests/fixtures/tf_checkpoint]

Every case trains a small model in TF for ``K`` steps with given gradients,
saves a checkpoint, then trains ``M`` more steps: the reference a torch run
continued from that checkpoint must reproduce. The model has three variables:
``dense/kernel`` (3, 4) in TF's [in, out] layout (torch's Linear weight is its
transpose), ``dense/bias`` (4,) and ``embedding/embeddings`` (6, 3), whose
gradients are ``IndexedSlices`` with repeated indices (TF's sparse rules).

Cases:

- ``name``: a ``tf.compat.v1.train.<Name>Optimizer`` in graph mode, saved by
  ``tf.compat.v1.train.Saver`` as ``model.ckpt-<K>`` with ``global_step``; every
  optimizer in float32 and float64, one with a non-default ``name=``, and Adam
  inside ``MixedPrecisionLossScaleOptimizer`` (a dynamic loss scale that grows
  and, at non-finite gradients, skips and shrinks);
- ``object``: the same optimizers (float32) and the loss-scale case, eager, in
  ``tf.train.Checkpoint(model=..., optimizer=..., step=...)``, whose names are
  object paths.

Also ``many_variables/model.ckpt``: 600 small variables, so that the index
spans many table blocks whose keys share prefixes (see ``write_many_variables``);
``partitioned/model.ckpt``: partitioned variables, stored in pieces (see
``write_partitioned``); and ``conv/model.ckpt``: a Conv2D + Dense model with
its output on a fixed input (see ``write_conv_model``).

Output: ``manifest.json`` (one entry per case; a name-based one also records
``tf_slot_names``, what TF named each slot variable: ``<variable>/<name>``); per case a folder with the
checkpoint (and its ``checkpoint`` state file) and ``arrays.npz`` holding
``init/<var>``, the gradients (``grad/<var>/<k>`` dense, or
``grad/<var>/<k>/indices`` and ``/values``), ``saved/<name>`` (every numeric
tensor of the checkpoint as ``tf.train.load_checkpoint`` reads it) and
``final/<var>``, ``final/<var>/<slot>``, ``final/non_slot/<name>``,
``final/loss_scale/<name>`` after ``K + M`` steps.

With ``--restore DIR`` it instead takes every name-based case that has a
checkpoint ``DIR/<case id>/model.ckpt-<K>`` (written by torch, say), builds the
case's TF graph, restores the checkpoint with ``Saver.restore``, runs steps
``K+1 .. K+M`` with the case's gradients (from ``--fixtures``) and writes the
``final/...`` arrays to ``DIR/<case id>/continued.npz``.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

K = 3  # steps before the checkpoint
M = 3  # steps after it
VARIABLES = {"dense/kernel": (3, 4), "dense/bias": (4,), "embedding/embeddings": (6, 3)}
SPARSE = "embedding/embeddings"
# Rows of the embedding's gradient at each step: duplicates, and rows left out.
SPARSE_ROWS = ([0, 2, 0], [1, 5], [2, 2, 4], [0, 3], [5, 1, 5], [4])
# Non-finite gradients at these steps in the loss-scale case (one before the save, one after).
NONFINITE_STEPS = (2, 5)

# (optimizer, constructor kwargs): arguments off their defaults where the math has them.
OPTIMIZERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("GradientDescent", {"learning_rate": 0.1}),
    ("Momentum", {"learning_rate": 0.05, "momentum": 0.9, "use_nesterov": True}),
    ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.5}),
    (
        "AdagradDA",
        {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.5},
    ),
    ("Adam", {"learning_rate": 0.1, "beta1": 0.5}),
    ("Adadelta", {"learning_rate": 1.0, "rho": 0.5, "epsilon": 1e-4}),
    ("RMSProp", {"learning_rate": 0.1, "momentum": 0.9}),
    ("RMSProp", {"learning_rate": 0.1, "momentum": 0.5, "centered": True}),
    ("Ftrl", {"learning_rate": 0.5, "l2_regularization_strength": 0.5}),
    (
        "ProximalAdagrad",
        {"learning_rate": 0.1, "initial_accumulator_value": 0.5, "l2_regularization_strength": 1.0},
    ),
    ("ProximalGradientDescent", {"learning_rate": 0.1, "l2_regularization_strength": 1.0}),
)
# TF's dense ProximalAdagrad / ProximalGradientDescent kernels reject float32
# hyperparameters for float64 variables (see make_tf_fixtures.py).
UNCAST_HYPERPARAMETERS = ("ProximalAdagrad", "ProximalGradientDescent")
LOSS_SCALE = {"initial_loss_scale": 8.0, "increment_period": 2, "multiplier": 2.0}


def cases() -> list[dict[str, Any]]:
    out = []
    for fmt, dtypes in (("name", ("float32", "float64")), ("object", ("float32",))):
        for name, kwargs in OPTIMIZERS:
            config = "centered" if kwargs.get("centered") else "default"
            for dtype in dtypes:
                out.append(_case(f"{fmt}-{name}-{config}-{dtype}", name, kwargs, dtype, fmt))
    out.append(
        _case("name-Adam-renamed-float32", "Adam", {"learning_rate": 0.1}, "float32", "name", "MyAdam")
    )
    for fmt in ("name", "object"):
        out.append(
            _case(
                f"{fmt}-Adam-loss_scale-float32",
                "Adam",
                {"learning_rate": 0.1},
                "float32",
                fmt,
                loss_scale=True,
            )
        )
    return out


def _case(
    case_id: str,
    name: str,
    kwargs: dict[str, Any],
    dtype: str,
    fmt: str,
    tf_name: str | None = None,
    loss_scale: bool = False,
) -> dict[str, Any]:
    return {
        "id": case_id,
        "optimizer": f"{name}Optimizer",
        "kwargs": kwargs,
        "dtype": dtype,
        "format": fmt,
        "optimizer_name": tf_name,
        "loss_scale": LOSS_SCALE if loss_scale else None,
        "steps_before": K,
        "steps_after": M,
        "variables": {var: list(shape) for var, shape in VARIABLES.items()},
        "prefix": f"{case_id}/model.ckpt-{K}" if fmt == "name" else f"{case_id}/ckpt-1",
    }


def make_inputs(case: dict[str, Any]) -> dict[str, np.ndarray]:
    """Initial values and every step's gradients, seeded by the case id less its dtype."""
    rng = np.random.default_rng(zlib.crc32(case["id"].rsplit("-", 1)[0].encode()))
    dtype = case["dtype"]
    arrays: dict[str, np.ndarray] = {}
    for var, shape in VARIABLES.items():
        arrays[f"init/{var}"] = rng.standard_normal(shape).astype(dtype)
    for k in range(1, K + M + 1):
        for var, shape in VARIABLES.items():
            if var == SPARSE:
                rows = SPARSE_ROWS[k - 1]
                arrays[f"grad/{var}/{k}/indices"] = np.array(rows, np.int64)
                arrays[f"grad/{var}/{k}/values"] = rng.standard_normal((len(rows), *shape[1:])).astype(dtype)
            else:
                grad = rng.standard_normal(shape).astype(dtype)
                if case["loss_scale"] and k in NONFINITE_STEPS and var == "dense/kernel":
                    grad[0, 0] = np.inf
                arrays[f"grad/{var}/{k}"] = grad
    return arrays


def build_optimizer(case: dict[str, Any], global_step: Any) -> Any:
    name = case["optimizer"].removesuffix("Optimizer")
    kwargs = dict(case["kwargs"])
    if name in UNCAST_HYPERPARAMETERS and case["dtype"] == "float64":
        for key in ("learning_rate", "l1_regularization_strength", "l2_regularization_strength"):
            kwargs[key] = tf.cast(tf.constant(kwargs.get(key, 0.0), tf.float32), tf.float64)
    if name == "AdagradDA":
        kwargs["global_step"] = global_step
    if case["optimizer_name"]:
        kwargs["name"] = case["optimizer_name"]
    opt = getattr(tf.compat.v1.train, case["optimizer"])(**kwargs)
    if case["loss_scale"]:
        scale = tf.compat.v1.mixed_precision.DynamicLossScale(**case["loss_scale"])
        opt = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(opt, scale)
    return opt


def _grad(arrays: dict[str, np.ndarray], var: str, k: int) -> Any:
    if var == SPARSE:
        values = arrays[f"grad/{var}/{k}/values"]
        indices = arrays[f"grad/{var}/{k}/indices"]
        return tf.IndexedSlices(
            tf.constant(values), tf.constant(indices), tf.constant(VARIABLES[var], tf.int64)
        )
    return tf.constant(arrays[f"grad/{var}/{k}"])


def _final(opt: Any, variables: dict[str, Any]) -> dict[str, Any]:
    """The tensors (graph) or variables (eager) the ``final/...`` arrays are read from."""
    inner = opt._optimizer if hasattr(opt, "_loss_scale") else opt
    out: dict[str, Any] = {}
    for var, v in variables.items():
        out[f"final/{var}"] = v
        for slot in inner.get_slot_names():
            out[f"final/{var}/{slot}"] = inner.get_slot(v, slot)
    for key, v in sorted(inner._non_slot_dict.items()):
        out[f"final/non_slot/{key[0]}"] = v
    if hasattr(opt, "_loss_scale"):
        out["final/loss_scale/current_loss_scale"] = opt._loss_scale()
        out["final/loss_scale/good_steps"] = opt._loss_scale._num_good_steps
    return out


class NameBasedRun:
    """A case's TF1 graph: variables, the optimizer, one train op per step, a Saver."""

    def __init__(self, case: dict[str, Any], arrays: dict[str, np.ndarray]):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.global_step = tf.compat.v1.train.get_or_create_global_step()
            self.variables = {
                var: tf.compat.v1.get_variable(var, initializer=arrays[f"init/{var}"], use_resource=True)
                for var in VARIABLES
            }
            opt = build_optimizer(case, self.global_step)
            self.train_ops = {}
            for k in range(1, K + M + 1):
                pairs = [(_grad(arrays, var, k), v) for var, v in self.variables.items()]
                # The loss-scale optimizer does not advance the step when it skips; count steps here.
                gs = None if case["loss_scale"] else self.global_step
                self.train_ops[k] = opt.apply_gradients(pairs, global_step=gs)
            self.final = _final(opt, self.variables)
            inner = opt._optimizer if case["loss_scale"] else opt
            # What TF named each slot variable of every variable: "<variable>/<this>".
            self.slot_names = {
                var: {
                    slot: inner.get_slot(v, slot).op.name[len(var) + 1 :] for slot in inner.get_slot_names()
                }
                for var, v in self.variables.items()
            }
            self.saver = tf.compat.v1.train.Saver(save_relative_paths=True)
            self.init = tf.compat.v1.global_variables_initializer()
            self.set_step = self.global_step.assign(K)
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
        self.sess = tf.compat.v1.Session(graph=self.graph, config=config)

    def run(self, steps: range) -> None:
        for k in steps:
            self.sess.run(self.train_ops[k])

    def finals(self) -> dict[str, np.ndarray]:
        return self.sess.run(self.final)


def run_name_based(
    case: dict[str, Any], arrays: dict[str, np.ndarray], folder: Path
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The case's arrays, and for the manifest the names TF gave the slot variables."""
    run = NameBasedRun(case, arrays)
    run.sess.run(run.init)
    run.run(range(1, K + 1))
    run.sess.run(run.set_step)
    with run.graph.as_default():
        prefix = run.saver.save(run.sess, str(folder / "model.ckpt"), global_step=K, write_meta_graph=False)
    run.run(range(K + 1, K + M + 1))
    finals = run.finals()
    run.sess.close()
    return {**_saved(prefix), **finals}, {"tf_slot_names": run.slot_names}


def run_object_based(
    case: dict[str, Any], arrays: dict[str, np.ndarray], folder: Path
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    model = tf.Module()
    model.dense = tf.Module()
    model.dense.kernel = tf.Variable(arrays["init/dense/kernel"])
    model.dense.bias = tf.Variable(arrays["init/dense/bias"])
    model.embedding = tf.Module()
    model.embedding.embeddings = tf.Variable(arrays[f"init/{SPARSE}"])
    variables = {
        "dense/kernel": model.dense.kernel,
        "dense/bias": model.dense.bias,
        SPARSE: model.embedding.embeddings,
    }
    step = tf.Variable(0, dtype=tf.int64)
    opt = build_optimizer(case, step)
    for k in range(1, K + M + 1):
        pairs = [(_grad(arrays, var, k), v) for var, v in variables.items()]
        if case["loss_scale"]:
            # The loss-scale optimizer does not advance the step when it skips; count steps here.
            opt.apply_gradients(pairs)
            step.assign_add(1)
        else:
            opt.apply_gradients(pairs, global_step=step)
        if k == K:
            prefix = tf.train.Checkpoint(model=model, optimizer=opt, step=step).save(str(folder / "ckpt"))
    finals = {key: value.numpy() for key, value in _final(opt, variables).items()}
    return {**_saved(prefix), **finals}, {}


def _saved(prefix: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(prefix)
    return {
        f"saved/{name}": reader.get_tensor(name)
        for name, _ in tf.train.list_variables(prefix)
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH"
    }


# A checkpoint whose index spans many table blocks, with shared key prefixes:
# variable i is ``block_<i // 10>/layer_with_a_long_name_<i % 10>/kernel``,
# shape (i % 7 + 1, 3), every element i.
MANY = 600


def write_many_variables(folder: Path) -> None:
    graph = tf.Graph()
    with graph.as_default():
        for i in range(MANY):
            tf.compat.v1.get_variable(
                f"block_{i // 10}/layer_with_a_long_name_{i % 10}/kernel",
                initializer=np.full((i % 7 + 1, 3), i, np.float32),
                use_resource=True,
            )
        saver = tf.compat.v1.train.Saver(save_relative_paths=True)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, str(folder / "model.ckpt"), write_meta_graph=False)


def write_partitioned(folder: Path) -> None:
    """Partitioned variables: ``emb`` (200, 3) in 3 pieces after one Adam step (its slots are
    partitioned too), and ``counts`` (20000, 1) in 2 pieces holding 0, 1, 2, ... (a piece
    starting at 10000 has a 3-byte key). ``values.npz`` holds what TF's reader assembles."""

    def rows_from(full: np.ndarray) -> Any:
        """An initializer giving each piece its rows of ``full``."""

        def init(shape: Any, dtype: Any = None, partition_info: Any = None) -> Any:
            start = partition_info.var_offset[0] if partition_info is not None else 0
            return tf.constant(full[start : start + shape[0]])

        return init

    graph = tf.Graph()
    with graph.as_default():
        emb = tf.compat.v1.get_variable(
            "emb",
            shape=(200, 3),
            initializer=rows_from(np.arange(600, dtype=np.float32).reshape(200, 3) / 100),
            partitioner=tf.compat.v1.fixed_size_partitioner(3),
            use_resource=True,
        )
        tf.compat.v1.get_variable(
            "counts",
            shape=(20000, 1),
            initializer=rows_from(np.arange(20000, dtype=np.float32).reshape(20000, 1)),
            partitioner=tf.compat.v1.fixed_size_partitioner(2),
            trainable=False,
            use_resource=True,
        )
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, tf.constant([0, 70, 150, 70])) ** 2)
        train_op = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
        saver = tf.compat.v1.train.Saver(save_relative_paths=True)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op)
            prefix = saver.save(sess, str(folder / "model.ckpt"), write_meta_graph=False)
    np.savez_compressed(folder / "values.npz", **_saved(prefix))


def write_conv_model(folder: Path) -> None:
    """A Conv2D (HWIO kernel) and a Dense layer after two Momentum steps, and the model's output.

    ``io.npz`` holds the input ``x`` (NHWC) and TF's output ``y`` from the saved weights, so a
    torch model (OIHW, NCHW) loaded from the checkpoint can be checked layer layout and all.
    """
    rng = np.random.default_rng(zlib.crc32(b"conv"))
    x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():

        def variable(name: str, shape: tuple[int, ...], scale: float) -> Any:
            value = (rng.standard_normal(shape) * scale).astype(np.float32)
            return tf.compat.v1.get_variable(name, initializer=value, use_resource=True)

        kernel, bias = variable("conv/kernel", (3, 3, 3, 4), 0.3), variable("conv/bias", (4,), 1.0)
        hidden = tf.reshape(tf.nn.conv2d(tf.constant(x), kernel, 1, "VALID") + bias, [2, -1])
        out = hidden @ variable("dense/kernel", (64, 5), 0.1) + variable("dense/bias", (5,), 1.0)
        train_op = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(tf.reduce_sum(out**2))
        saver = tf.compat.v1.train.Saver(save_relative_paths=True)
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(2):
                sess.run(train_op)
            saver.save(sess, str(folder / "model.ckpt"), write_meta_graph=False)
            y = sess.run(out)
    np.savez_compressed(folder / "io.npz", x=x, y=y)


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "many_variables").mkdir(exist_ok=True)
    write_many_variables(out / "many_variables")
    (out / "partitioned").mkdir(exist_ok=True)
    write_partitioned(out / "partitioned")
    (out / "conv").mkdir(exist_ok=True)
    write_conv_model(out / "conv")
    manifest = []
    for case in cases():
        folder = out / case["id"]
        folder.mkdir(exist_ok=True)
        inputs = make_inputs(case)
        runner = run_name_based if case["format"] == "name" else run_object_based
        arrays, extra = runner(case, inputs, folder)
        np.savez_compressed(folder / "arrays.npz", **inputs, **arrays)
        manifest.append({**case, **extra, "tf_version": tf.__version__})
    lines = ",\n".join(json.dumps(entry) for entry in manifest)
    (out / "manifest.json").write_text(f"[\n{lines}\n]\n")


def restore_and_continue(folder: Path, fixtures: Path) -> None:
    """For every name-based case with a checkpoint ``folder/<id>/model.ckpt-<K>`` (written by anyone),
    restore it into the case's graph, run the last M steps and write ``folder/<id>/continued.npz``."""
    for case in json.loads((fixtures / "manifest.json").read_text()):
        prefix = folder / case["id"] / f"model.ckpt-{K}"
        if case["format"] != "name" or not Path(f"{prefix}.index").is_file():
            continue
        with np.load(fixtures / case["id"] / "arrays.npz") as npz:
            arrays = {key: npz[key] for key in npz.files}
        run = NameBasedRun(case, arrays)
        with run.graph.as_default():
            run.saver.restore(run.sess, str(prefix))
        if run.sess.run(run.global_step) != K:
            raise RuntimeError(
                f"{case['id']}: restored global_step is {run.sess.run(run.global_step)}, not {K}"
            )
        run.run(range(K + 1, K + M + 1))
        np.savez(folder / case["id"] / "continued.npz", **run.finals())
        run.sess.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("tests/fixtures/tf_checkpoint"), help="output folder"
    )
    parser.add_argument(
        "--restore", type=Path, help="a folder of <case id>/model.ckpt-K checkpoints to restore and continue"
    )
    parser.add_argument("--fixtures", type=Path, default=Path("tests/fixtures/tf_checkpoint"))
    args = parser.parse_args()
    if args.restore:
        restore_and_continue(args.restore, args.fixtures)
    else:
        generate(args.out)


if __name__ == "__main__":
    main()
