"""Train scripts/train.py's model in TensorFlow 1 style, save a checkpoint midway, and record the rest.

Run with an interpreter that has TensorFlow (no torch needed), on batches
that scripts/train.py exported (so both frameworks eat the same data)::

    python scripts/train.py --export-batches batches.npz --steps 10
    python scripts/make_tf_train_checkpoint.py --batches batches.npz --out tests/fixtures/tf_train

The TF1 graph is train.py's ``Classifier`` as a TF user writes it, with the
names Keras gives by default: ``embedding/embeddings`` [100, 8] looked up with
``tf.nn.embedding_lookup`` (so its gradient is ``IndexedSlices`` and the
optimizer's sparse rule runs), ``dense/kernel`` [24, 32] + ``dense/bias``,
ReLU, ``dense_1/kernel`` [32, 4] + ``dense_1/bias``; the mean sparse softmax
cross-entropy; ``opt.minimize(loss, global_step)``. Every optimizer of
train.py, with train.py's hyperparameters (``TRAIN_OPTIMIZERS`` below), is
trained ``K`` steps from TF's own initialisation, saved by
``tf.compat.v1.train.Saver`` as ``<optimizer>/model.ckpt-<K>``, then trained
``M`` more steps. ``<optimizer>/reference.npz`` holds the losses of steps
``K+1 .. K+M`` (``loss/<k>``, each before its update) and every variable
after step ``K+M`` (``final/<name>``, TF's layout: the weights, the slots,
the optimizer-wide state and, with ``--loop``, the moving averages).
``manifest.json`` lists the cases and the TF version.

``--loop`` trains the rest of a TF1 training loop too, the one
``train.py --decay cosine --warmup-steps W --decay-steps D --clip-norm C --ema E --decay-graph``
runs (``LOOP`` below; the flags are in the manifest): the learning rate is
BERT's linear warm-up to ``lr`` over ``W`` steps, then ``cosine_decay(lr,
global_step, D, alpha=0.01)``, read at the global step before the update; the
gradients (the embedding's ``IndexedSlices`` too) are clipped by their global
norm before ``apply_gradients``; an ``ExponentialMovingAverage(E,
num_updates=global_step)`` of the trainable variables is applied after each
update, its shadows starting at the initial weights. Its default optimizers
are Momentum and Adam::

    python scripts/train.py --export-batches batches.npz --steps 10
    python scripts/make_tf_train_checkpoint.py --batches batches.npz --loop --out tests/fixtures/tf_train_loop

``--restore PREFIX`` runs the other direction: the graph restores a checkpoint
of step ``K`` (one ``save_tf_checkpoint`` wrote of a torch run) instead of
initialising, and trains steps ``K+1 .. K+M``; ``reference.npz`` holds the
same entries.

``--dtype float64`` builds the graph in float64 (the features are cast; the
learning rate stays TF's float32 decay, cast by the optimizers). train.py
trains in float32 only: tests/checkpoint/test_tf_train_loop.py runs its loop in float64
through the library's API.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

K = 5  # steps before the checkpoint
M = 5  # steps after it
NUM_FEATURES, NUM_TOKENS, NUM_CLASSES, EMBEDDING_DIM, HIDDEN = 16, 100, 4, 8, 32
# train.py's OPTIMIZERS, as TF's classes: the hyperparameters must be the same, or the
# continued runs differ (the test that compares them would fail).
TRAIN_OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "gradient_descent": ("GradientDescentOptimizer", {"learning_rate": 0.5}),
    "momentum": ("MomentumOptimizer", {"learning_rate": 0.1, "momentum": 0.9}),
    "adagrad": ("AdagradOptimizer", {"learning_rate": 0.5}),
    "adagrad_da": ("AdagradDAOptimizer", {"learning_rate": 0.5}),
    "adam": ("AdamOptimizer", {"learning_rate": 0.01}),
    "adadelta": ("AdadeltaOptimizer", {"learning_rate": 1.0, "epsilon": 1e-6}),
    "rmsprop": ("RMSPropOptimizer", {"learning_rate": 0.03}),
    "ftrl": ("FtrlOptimizer", {"learning_rate": 0.5, "l1_regularization_strength": 0.001}),
    "proximal_adagrad": (
        "ProximalAdagradOptimizer",
        {"learning_rate": 0.5, "l1_regularization_strength": 0.001},
    ),
    "proximal_gradient_descent": (
        "ProximalGradientDescentOptimizer",
        {"learning_rate": 0.5, "l1_regularization_strength": 0.001},
    ),
}
# --loop: train.py's flags of the loop. The steps after the checkpoint (global steps K..K+M-1)
# see all three parts of the learning rate: the warm-up (< 7), the cosine (7, 8) and its floor
# past decay_steps. The clip norm is below the gradients' global norm at every step of the
# fixture, so that the clipping scales them.
LOOP = {"warmup_steps": 7, "decay_steps": 8, "clip_norm": 0.5, "ema": 0.99}
LOOP_OPTIMIZERS = ["adam", "momentum"]


def loop_flags(loop: dict[str, Any]) -> list[str]:
    """train.py's command-line flags for the loop ``loop`` describes."""
    return [
        "--decay",
        "cosine",
        "--warmup-steps",
        str(loop["warmup_steps"]),
        "--decay-steps",
        str(loop["decay_steps"]),
        "--clip-norm",
        str(loop["clip_norm"]),
        "--ema",
        str(loop["ema"]),
        # The loop's decay runs in this script's TF1 graph, whose Grappler rewrites it.
        "--decay-graph",
    ]


def warmup_cosine(lr: float, global_step: Any, loop: dict[str, Any]) -> Any:
    """train.py's --decay cosine --warmup-steps: BERT's warm-up (optimization.create_optimizer)."""
    decayed = tf.compat.v1.train.cosine_decay(lr, global_step, loop["decay_steps"], alpha=0.01)
    step = tf.cast(global_step, tf.float32)
    warmup = lr * (step / tf.cast(loop["warmup_steps"], tf.float32))
    return tf.where(global_step < loop["warmup_steps"], warmup, decayed)


def run_case(
    name: str,
    batches: dict[str, np.ndarray],
    folder: Path,
    seed: int,
    loop: dict[str, Any] | None = None,
    restore: Path | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    cls, kwargs = TRAIN_OPTIMIZERS[name]
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        features = tf.compat.v1.placeholder(dtype, [None, NUM_FEATURES])
        tokens = tf.compat.v1.placeholder(tf.int64, [None])
        labels = tf.compat.v1.placeholder(tf.int64, [None])
        glorot = tf.compat.v1.glorot_uniform_initializer()
        zeros = tf.compat.v1.zeros_initializer()
        with tf.compat.v1.variable_scope("embedding"):
            embeddings = tf.compat.v1.get_variable(
                "embeddings",
                [NUM_TOKENS, EMBEDDING_DIM],
                dtype,
                initializer=tf.compat.v1.random_normal_initializer(),
            )
        layers = []
        for scope, shape in (
            ("dense", (NUM_FEATURES + EMBEDDING_DIM, HIDDEN)),
            ("dense_1", (HIDDEN, NUM_CLASSES)),
        ):
            with tf.compat.v1.variable_scope(scope):
                layers.append(
                    (
                        tf.compat.v1.get_variable("kernel", shape, dtype, initializer=glorot),
                        tf.compat.v1.get_variable("bias", shape[1:], dtype, initializer=zeros),
                    )
                )
        x = tf.concat([features, tf.nn.embedding_lookup(embeddings, tokens)], axis=1)
        hidden = tf.nn.relu(tf.matmul(x, layers[0][0]) + layers[0][1])
        logits = tf.matmul(hidden, layers[1][0]) + layers[1][1]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        kwargs = dict(kwargs)
        if cls == "AdagradDAOptimizer":
            kwargs["global_step"] = global_step  # TF's AdagradDA counts with the global step
        if loop is None:
            train_op = getattr(tf.compat.v1.train, cls)(**kwargs).minimize(loss, global_step=global_step)
            norm = tf.constant(np.nan)
        else:
            kwargs["learning_rate"] = warmup_cosine(kwargs["learning_rate"], global_step, loop)
            opt = getattr(tf.compat.v1.train, cls)(**kwargs)
            grads, params = zip(*opt.compute_gradients(loss), strict=True)
            clipped, norm = tf.clip_by_global_norm(list(grads), loop["clip_norm"])
            update = opt.apply_gradients(zip(clipped, params, strict=True), global_step=global_step)
            ema = tf.compat.v1.train.ExponentialMovingAverage(loop["ema"], num_updates=global_step)
            with tf.control_dependencies([update]):  # the averages of the updated weights
                train_op = ema.apply(tf.compat.v1.trainable_variables())
        variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
        saver = tf.compat.v1.train.Saver(save_relative_paths=True)
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    reference: dict[str, np.ndarray] = {}
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        if restore is None:
            sess.run(init)
        else:
            saver.restore(sess, str(restore))
        for k in range(1 if restore is None else K + 1, K + M + 1):
            feed = {
                features: batches["features"][k - 1].astype(dtype),
                tokens: batches["tokens"][k - 1],
                labels: batches["labels"][k - 1],
            }
            step_loss, step_norm, _ = sess.run([loss, norm, train_op], feed)
            if k > K:
                reference[f"loss/{k}"] = np.asarray(step_loss)
            if loop is not None:
                reference[f"global_norm/{k}"] = np.asarray(step_norm)
            if k == K and restore is None:
                with graph.as_default():
                    saver.save(sess, str(folder / "model.ckpt"), global_step=K, write_meta_graph=False)
        for var_name, value in sess.run(variables).items():
            reference[f"final/{var_name}"] = value
    np.savez(folder / "reference.npz", **reference)
    case = {
        "optimizer": name,
        "tf_class": cls,
        "kwargs": TRAIN_OPTIMIZERS[name][1],
        "prefix": f"{name}/model.ckpt-{K}",
    }
    if loop is not None:
        case["train_py_flags"] = loop_flags(loop)
        case["dtype"] = dtype
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--batches", type=Path, required=True, help="from train.py --export-batches (K+M steps)"
    )
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/tf_train"))
    parser.add_argument("--optimizer", nargs="*", choices=sorted(TRAIN_OPTIMIZERS))
    parser.add_argument(
        "--loop",
        action="store_true",
        help="train with train.py's --decay cosine --warmup-steps --decay-steps --clip-norm --ema (LOOP)",
    )
    parser.add_argument("--seed", type=int, default=0, help="TF's graph-level seed (its initialisation)")
    parser.add_argument(
        "--restore",
        type=Path,
        help=f"start from this checkpoint of step {K} (one optimizer) and train steps {K + 1}..{K + M}",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="of the variables and features (float64: train.py's loop in float64, as a library user runs it)",
    )
    args = parser.parse_args()
    with np.load(args.batches) as npz:
        batches = {key: npz[key] for key in npz.files}
    if len(batches["features"]) < K + M:
        parser.error(
            f"--batches {str(args.batches)!r} holds {len(batches['features'])} steps; {K + M} needed"
        )
    if args.optimizer is None:
        args.optimizer = LOOP_OPTIMIZERS if args.loop else sorted(TRAIN_OPTIMIZERS)
    if args.restore is not None and len(args.optimizer) != 1:
        parser.error(f"--restore continues one optimizer's run; --optimizer gave {args.optimizer}")
    loop = LOOP if args.loop else None
    manifest = []
    for name in args.optimizer:
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        case = run_case(name, batches, folder, args.seed, loop, args.restore, args.dtype)
        manifest.append({**case, "steps_before": K, "steps_after": M})
    text = json.dumps({"tf_version": tf.__version__, "cases": manifest}, indent=1)
    (args.out / "manifest.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
