"""Write the TensorFlow ground truth that tests/train/test_moving_averages.py checks the EMA against.

Run with an interpreter that has TensorFlow (no torch needed)::

    python scripts/make_tf_ema_fixtures.py [--out tests/fixtures/train]

Each case is a TF 1 graph, as a TF 1 training loop builds it: two variables
(``dense/kernel`` 2x3 and ``dense/bias`` 3) trained by
``tf.compat.v1.train.MomentumOptimizer`` (or ``GradientDescentOptimizer``) on
gradients fed from a seeded generator, with ``apply_gradients(global_step=...)``,
and a ``tf.compat.v1.train.ExponentialMovingAverage`` whose ``apply`` runs after
each optimizer step (``control_dependencies``), over the variables and, in some
cases, a fed tensor ``moments/mean`` (TF's non-Variable input: its shadow starts
at zero, and is debiased with ``zero_debias=True``). The shadows start from the
variables' initial values (TF's initializer). Cases: with and without
``num_updates=global_step`` (from 0, and from 2**24 + 1, where the cast to
float32 rounds), ``zero_debias``, float32, float64, float16 and bfloat16.

Output, deterministic: ``ema.json`` with ``tf_version`` and ``cases``: ``id``,
``dtype``, the constructor's ``kwargs``, ``optimizer``, ``global_step0``, the
initial ``variables``, per step the fed ``grads`` and ``tensor`` and the values
after the step (``variables``, ``averages`` and, for zero debiasing, ``biased``
and ``local_step``) as flat lists of floats (exact: every float32, float16,
bfloat16 and float64 is a double), and TF's names: ``average_names``,
``variables_to_restore`` (its keys for the trainable variables) and the graph's
``global_variables``.
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

tf.compat.v1.disable_eager_execution()

STEPS = 50
SHAPES = {"dense/kernel": (2, 3), "dense/bias": (3,)}
TENSOR = "moments/mean"
TENSOR_SHAPE = (3,)


def build_cases() -> list[dict[str, Any]]:
    cases = []
    for dtype in ("float32", "float64"):
        cases += [
            {"id": f"decay_{dtype}", "dtype": dtype, "kwargs": {"decay": 0.9}, "tensor": True},
            {"id": f"num_updates_{dtype}", "dtype": dtype, "kwargs": {"decay": 0.99, "num_updates": True}},
            {
                "id": f"num_updates_large_{dtype}",
                "dtype": dtype,
                "kwargs": {"decay": 0.9999999, "num_updates": True},
                "global_step0": 2**24 + 1,
            },
            {
                "id": f"zero_debias_{dtype}",
                "dtype": dtype,
                "kwargs": {"decay": 0.9, "zero_debias": True},
                "tensor": True,
            },
            {
                "id": f"zero_debias_num_updates_{dtype}",
                "dtype": dtype,
                "kwargs": {"decay": 0.999, "num_updates": True, "zero_debias": True},
                "tensor": True,
                "optimizer": "GradientDescent",
            },
        ]
    for dtype in ("float16", "bfloat16"):
        cases.append(
            {
                "id": f"decay_{dtype}",
                "dtype": dtype,
                "kwargs": {"decay": 0.99, "zero_debias": True},
                "tensor": True,
                "optimizer": "GradientDescent",
            }
        )
    for case in cases:
        case.setdefault("tensor", False)
        case.setdefault("optimizer", "Momentum")
        case.setdefault("global_step0", 0)
    return cases


def flat(a: Any) -> list[float]:
    return [float(x) for x in np.asarray(a).reshape(-1)]


def run(case: dict[str, Any], seed: int) -> dict[str, Any]:
    dtype = tf.as_dtype(case["dtype"]).as_numpy_dtype  # bfloat16: ml_dtypes' type
    rng = np.random.default_rng(seed)
    initial = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
    grads = [{n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()} for _ in range(STEPS)]
    tensors = [(rng.standard_normal(TENSOR_SHAPE) + 2.0).astype(dtype) for _ in range(STEPS)]
    graph = tf.Graph()
    with graph.as_default():
        global_step = tf.compat.v1.get_variable(
            "global_step",
            initializer=np.int64(case["global_step0"]),
            dtype=tf.int64,
            trainable=False,
        )
        variables = {n: tf.compat.v1.get_variable(n, initializer=v) for n, v in initial.items()}
        grad_feeds = {
            n: tf.compat.v1.placeholder(dtype, s, name=f"grad_{i}") for i, (n, s) in enumerate(SHAPES.items())
        }
        tensor_feed = tf.compat.v1.placeholder(dtype, TENSOR_SHAPE, name=TENSOR)
        if case["optimizer"] == "Momentum":
            opt = tf.compat.v1.train.MomentumOptimizer(learning_rate=0.05, momentum=0.9)
        else:
            opt = tf.compat.v1.train.GradientDescentOptimizer(learning_rate=0.05)
        train = opt.apply_gradients([(grad_feeds[n], variables[n]) for n in SHAPES], global_step=global_step)
        kwargs = dict(case["kwargs"])
        if kwargs.pop("num_updates", False):
            kwargs["num_updates"] = global_step
        ema = tf.compat.v1.train.ExponentialMovingAverage(**kwargs)
        averaged = [variables[n] for n in SHAPES] + ([tensor_feed] if case["tensor"] else [])
        with tf.control_dependencies([train]):
            update = ema.apply(averaged)
        averages = {n: ema.average(variables[n]) for n in SHAPES}
        if case["tensor"]:
            averages[TENSOR] = ema.average(tensor_feed)
        debias = {
            v.op.name: v
            for v in tf.compat.v1.global_variables()
            if v.op.name.endswith(("/biased", "/local_step"))
        }
        names = {
            "average_names": {n: ema.average_name(variables[n]) for n in SHAPES},
            "variables_to_restore": sorted(
                k for k, v in ema.variables_to_restore().items() if v.op.name in SHAPES
            ),
            "global_variables": sorted(v.op.name for v in tf.compat.v1.global_variables()),
        }
        if case["tensor"]:
            names["average_names"][TENSOR] = ema.average_name(tensor_feed)
        steps = []
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for k in range(STEPS):
                feed = {grad_feeds[n]: grads[k][n] for n in SHAPES}
                feed[tensor_feed] = tensors[k]
                sess.run(update, feed_dict=feed)
                out = sess.run({"variables": variables, "averages": averages, "debias": debias})
                record = {
                    "grads": {n: flat(grads[k][n]) for n in SHAPES},
                    "variables": {n: flat(v) for n, v in out["variables"].items()},
                    "averages": {n: flat(v) for n, v in out["averages"].items()},
                    "debias": {n: flat(v) for n, v in sorted(out["debias"].items())},
                }
                if case["tensor"]:
                    record["tensor"] = flat(tensors[k])
                steps.append(record)
    return {
        **case,
        "variables": {n: {"shape": list(SHAPES[n]), "value": flat(v)} for n, v in initial.items()},
        "tensor_shape": list(TENSOR_SHAPE),
        **names,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/train"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [run(case, seed) for seed, case in enumerate(build_cases())]
    manifest = {"tf_version": tf.__version__, "cases": cases}
    (args.out / "ema.json").write_text(json.dumps(manifest, indent=None, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
