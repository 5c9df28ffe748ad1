"""Compare Keras 3 optimizers with the tf.compat.v1.train optimizer of the same math.

The measurement behind the Keras table of docs/checkpoint.md.

Run with an interpreter that has TensorFlow (no torch needed)::

    python scripts/compare_keras_optimizers.py

Each pair trains a (4, 3) float32 variable for 20 eager steps on the same seeded
gradients; the output is a Markdown table of the largest absolute difference
and that difference relative to the largest value.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np
import tensorflow as tf

V1 = tf.compat.v1.train
# Keras's optimizer, the v1 optimizer (epsilon set to Keras's 1e-7 where both have one).
PAIRS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "Adam": (lambda: keras.optimizers.Adam(0.1), lambda: V1.AdamOptimizer(0.1, epsilon=1e-7)),
    "SGD": (lambda: keras.optimizers.SGD(0.1), lambda: V1.GradientDescentOptimizer(0.1)),
    "SGD momentum": (
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: V1.MomentumOptimizer(0.1, 0.9),
    ),
    "SGD nesterov": (
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        lambda: V1.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
    ),
    "Adagrad": (lambda: keras.optimizers.Adagrad(0.1), lambda: V1.AdagradOptimizer(0.1)),
    "Adadelta": (lambda: keras.optimizers.Adadelta(1.0), lambda: V1.AdadeltaOptimizer(1.0, epsilon=1e-7)),
    "RMSprop": (lambda: keras.optimizers.RMSprop(0.01), lambda: V1.RMSPropOptimizer(0.01, epsilon=1e-7)),
    "Ftrl": (lambda: keras.optimizers.Ftrl(0.5), lambda: V1.FtrlOptimizer(0.5)),
}


def train(opt: Any, init: np.ndarray, grads: np.ndarray) -> np.ndarray:
    var = tf.Variable(init)
    for grad in grads:
        opt.apply_gradients([(tf.constant(grad), var)])
    return var.numpy()


def main() -> None:
    rng = np.random.default_rng(0)
    init = rng.standard_normal((4, 3)).astype("float32")
    grads = rng.standard_normal((20, 4, 3)).astype("float32")
    print(f"Keras {keras.__version__}, TensorFlow {tf.__version__}\n")
    print("| Keras | max abs difference | relative to the largest value |")
    print("|---|---|---|")
    for name, (make_keras, make_v1) in PAIRS.items():
        ours, theirs = train(make_keras(), init, grads), train(make_v1(), init, grads)
        diff = float(np.abs(ours - theirs).max())
        print(f"| {name} | {diff:.3g} | {diff / float(np.abs(theirs).max()):.3g} |")


if __name__ == "__main__":
    main()
