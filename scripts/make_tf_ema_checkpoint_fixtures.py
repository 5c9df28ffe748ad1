"""Write the TF1 checkpoint of a model, its Momentum slots and its moving averages that
tests/checkpoint/test_tf_ema_checkpoint.py loads into torch.

Run with an interpreter that has TensorFlow (no torch needed)::

    python scripts/make_tf_ema_checkpoint_fixtures.py [--out tests/fixtures/tf_ema_checkpoint]

A TF1 graph: ``dense/kernel`` (3, 4) and ``dense/bias`` (4,), trained by
``tf.compat.v1.train.MomentumOptimizer`` for ``K`` steps with given gradients,
each step followed by ``tf.compat.v1.train.ExponentialMovingAverage.apply`` of
the two variables and of the tensor ``moments/mean`` (the kernel's row means,
a non-Variable input: its average is zero-debiased, with ``biased`` and
``local_step`` beside it). ``num_updates`` is the global step. ``Saver``
writes ``model.ckpt-<K>``.

Output: the checkpoint (and its ``checkpoint`` state file) and ``arrays.npz``
holding ``init/<var>``, ``grad/<var>/<k>`` and ``saved/<name>``, every tensor
of the checkpoint as ``tf.train.load_checkpoint`` reads it.

With ``--restore PREFIX`` it instead builds the same graph, restores the
checkpoint at ``PREFIX`` (written by torch, say) with ``Saver.restore`` and
writes ``<PREFIX>.restored.npz``: every variable of the graph as TF then holds
it, the shadows read through ``ema.average(...)``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

K = 3
VARIABLES = {"dense/kernel": (3, 4), "dense/bias": (4,)}
LEARNING_RATE = 0.05
MOMENTUM = 0.9
DECAY = 0.9
TENSOR = "moments/mean"


def make_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261202)
    arrays = {}
    for name, shape in VARIABLES.items():
        arrays[f"init/{name}"] = rng.standard_normal(shape).astype(np.float32)
        for k in range(1, K + 1):
            arrays[f"grad/{name}/{k}"] = rng.standard_normal(shape).astype(np.float32)
    return arrays


class Graph:
    """The TF1 graph: variables, Momentum, the moving averages, one train op per step's gradients."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.variables = {
                name: tf.compat.v1.get_variable(name, initializer=arrays[f"init/{name}"], use_resource=True)
                for name in VARIABLES
            }
            self.global_step = tf.compat.v1.train.get_or_create_global_step()
            self.grads = {
                name: tf.compat.v1.placeholder(tf.float32, shape) for name, shape in VARIABLES.items()
            }
            opt = tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM)
            step = opt.apply_gradients(
                [(self.grads[n], v) for n, v in self.variables.items()], global_step=self.global_step
            )
            self.ema = tf.compat.v1.train.ExponentialMovingAverage(
                DECAY, num_updates=self.global_step, zero_debias=True
            )
            with tf.control_dependencies([step]):
                mean = tf.reduce_mean(self.variables["dense/kernel"], axis=1, name=TENSOR)
                self.train = self.ema.apply([*self.variables.values(), mean])
            self.mean = mean
            self.saver = tf.compat.v1.train.Saver()
            self.init = tf.compat.v1.global_variables_initializer()
        self.session = tf.compat.v1.Session(graph=self.graph)

    def run(self, arrays: dict[str, np.ndarray]) -> None:
        self.session.run(self.init)
        for k in range(1, K + 1):
            feed = {self.grads[n]: arrays[f"grad/{n}/{k}"] for n in VARIABLES}
            self.session.run(self.train, feed)

    def values(self) -> dict[str, np.ndarray]:
        """Every variable of the graph by name, the shadows as ``ema.average`` finds them."""
        with self.graph.as_default():
            named = {v.op.name: v for v in tf.compat.v1.global_variables()}
            for name, var in self.variables.items():
                assert self.ema.average(var) is named[f"{name}/ExponentialMovingAverage"]
            assert self.ema.average(self.mean) is named[f"{TENSOR}/ExponentialMovingAverage"]
        return dict(zip(named, self.session.run(list(named.values())), strict=True))


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays = make_inputs()
    graph = Graph(arrays)
    graph.run(arrays)
    with graph.graph.as_default():
        prefix = graph.saver.save(
            graph.session, str(out / "model.ckpt"), global_step=K, write_meta_graph=False
        )
    reader = tf.train.load_checkpoint(prefix)
    for name in reader.get_variable_to_shape_map():
        arrays[f"saved/{name}"] = np.asarray(reader.get_tensor(name))
    np.savez(out / "arrays.npz", **arrays)


def restore(prefix: str) -> None:
    graph = Graph(make_inputs())
    with graph.graph.as_default():
        graph.saver.restore(graph.session, prefix)
    np.savez(f"{prefix}.restored.npz", **graph.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("tests/fixtures/tf_ema_checkpoint"), help="output folder"
    )
    parser.add_argument("--restore", help="restore this checkpoint prefix and dump the graph's variables")
    args: Any = parser.parse_args()
    if args.restore:
        restore(args.restore)
    else:
        generate(args.out)


if __name__ == "__main__":
    main()
