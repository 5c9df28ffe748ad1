"""Write the TensorFlow reference values that tests/gradients/test_gradients.py checks against.

Runs ``tf.compat.v1.gradients`` and ``tf.compat.v1.hessians`` in graph mode on
small seeded inputs, in float32 and float64, and writes one JSON file per
function under ``tests/fixtures/gradients/``. Each case records its inputs, the
options passed, and the result per ``x``: an array, ``null`` (TF's None), a
sparse ``IndexedSlices`` (indices, values, dense shape), or the error TF raised.
The test file builds the same computation in PyTorch from the case name.

Needs TensorFlow and numpy only (no torch):

    TF_CPP_MIN_LOG_LEVEL=2 /work/tfvenv/bin/python scripts/make_tf_gradient_fixtures.py
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf

tf1 = tf.compat.v1
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gradients"
DTYPES = ("float32", "float64")

# name -> shapes of the random inputs. Inputs named gy* are grad_ys weights.
SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    "two_ys": {"x": (4,)},
    "y_is_x": {"x": (4,)},
    "grad_ys": {"x": (4,), "w": (3, 4), "gy0": (4,), "gy1": (3,)},
    "grad_ys_partial": {"x": (4,), "w": (3, 4), "gy0": (4,)},
    "mlp": {"x": (5,), "w1": (4, 5), "b1": (4,), "w2": (4,)},
    "mlp_tree": {"x": (5,), "w1": (4, 5), "b1": (4,), "w2": (4,)},
    "stop_doc": {"a": ()},
    "stop_doc_total": {"a": ()},
    "stop_chain": {"x": (3,)},
    "stop_blocks_all": {"x": (3,)},
    "stop_blocks_all_zero": {"x": (3,)},
    "stop_split": {"x": (3,)},
    "stop_leaf_in_xs": {"x": (3,)},
    "stop_only_x": {"x": (3,)},
    "unconnected_none": {"x": (3,), "z": (2,)},
    "unconnected_zero": {"x": (3,), "z": (2,)},
    "unconnected_enum": {"x": (3,), "z": (2,)},
    "second_order": {"x": (4,)},
    "sparse_gather": {"params": (5, 3), "w": (3, 3)},
    "sparse_two_gathers": {"params": (5, 3)},
    "hess_vector": {"x": (4,), "a": (4, 4)},
    "hess_multi_xs": {"x": (3,), "w": (2, 3)},
    "hess_multi_ys": {"x": (3,), "w": (2, 3)},
    "hess_scalar_x": {"x": ()},
    "hess_linear": {"x": (3,)},
}


Builders = Callable[[dict[str, Any]], dict[str, Callable[[], dict[str, Any]]]]


def _grad_cases(v: dict[str, Any]) -> dict[str, Callable[[], dict[str, Any]]]:
    """TF builders for ``gradients``: each returns the arguments of one call."""

    def mlp() -> tf.Tensor:
        hidden = tf.tanh(tf.linalg.matvec(v["w1"], v["x"]) + v["b1"])
        return [tf.reduce_sum(v["w2"] * hidden), tf.sigmoid(tf.linalg.matvec(v["w1"], v["x"]))]

    def stop_doc() -> dict[str, Any]:
        b = 2.0 * v["a"]
        return {"ys": v["a"] + b, "xs": [v["a"], b], "stop_gradients": [v["a"], b]}

    def stop_doc_total() -> dict[str, Any]:
        b = 2.0 * v["a"]
        return {"ys": v["a"] + b, "xs": [v["a"], b]}

    def stop_chain() -> dict[str, Any]:
        h = v["x"] * v["x"]
        return {"ys": tf.sin(h) + h * v["x"], "xs": [v["x"], h], "stop_gradients": [h]}

    def stop_only_x() -> dict[str, Any]:
        h = v["x"] * v["x"]
        return {"ys": tf.sin(h) + h, "xs": [h], "stop_gradients": [h]}

    def stop_blocks_all(zero: bool) -> dict[str, Any]:
        h = v["x"] * v["x"]
        out = {"ys": tf.sin(h), "xs": [v["x"]], "stop_gradients": [h]}
        return out | ({"unconnected_gradients": "zero"} if zero else {})

    def stop_split() -> dict[str, Any]:
        a, b = tf.split(v["x"] * 1.0, [1, 2])
        y = 3.0 * tf.reduce_sum(a) + tf.reduce_sum(b * b) + tf.reduce_sum(v["x"])
        return {"ys": y, "xs": [v["x"], a, b], "stop_gradients": [a]}

    def unconnected(mode: Any) -> dict[str, Any]:
        return {"ys": v["x"] * v["x"], "xs": [v["x"], v["z"]], "unconnected_gradients": mode}

    def two_gathers() -> dict[str, Any]:
        p = v["params"]
        y = tf.reduce_sum(2.0 * tf.gather(p, [0, 0, 2])) + tf.reduce_sum(tf.gather(p, [4, 0]))
        return {"ys": y, "xs": [p]}

    return {
        "two_ys": lambda: {"ys": [v["x"] * v["x"], 2.0 * v["x"]], "xs": [v["x"]]},
        "y_is_x": lambda: {"ys": [v["x"], v["x"] * v["x"]], "xs": [v["x"]]},
        "grad_ys": lambda: {
            "ys": [v["x"] * v["x"], tf.tanh(tf.linalg.matvec(v["w"], v["x"]))],
            "xs": [v["x"], v["w"]],
            "grad_ys": [v["gy0"], v["gy1"]],
        },
        "grad_ys_partial": lambda: {
            "ys": [v["x"] * v["x"], tf.tanh(tf.linalg.matvec(v["w"], v["x"]))],
            "xs": [v["x"], v["w"]],
            "grad_ys": [v["gy0"], None],
        },
        "mlp": lambda: {"ys": mlp(), "xs": [v["w1"], v["b1"], v["w2"], v["x"]]},
        "mlp_tree": lambda: {
            "ys": mlp(),
            "xs": [v["w1"], v["b1"], v["w2"], v["x"]],
            "aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE,
        },
        "stop_doc": stop_doc,
        "stop_doc_total": stop_doc_total,
        "stop_chain": stop_chain,
        "stop_blocks_all": lambda: stop_blocks_all(zero=False),
        "stop_blocks_all_zero": lambda: stop_blocks_all(zero=True),
        "stop_split": stop_split,
        "stop_only_x": stop_only_x,
        "stop_leaf_in_xs": lambda: {
            "ys": tf.reduce_sum(tf.sin(v["x"]) * v["x"]),
            "xs": [v["x"]],
            "stop_gradients": [v["x"]],
        },
        "unconnected_none": lambda: unconnected("none"),
        "unconnected_zero": lambda: unconnected("zero"),
        "unconnected_enum": lambda: unconnected(tf.UnconnectedGradients.ZERO),
        "second_order": lambda: {
            "ys": tf1.gradients(tf.reduce_sum(v["x"] ** 3 * tf.sin(v["x"])), v["x"])[0],
            "xs": [v["x"]],
        },
        "sparse_gather": lambda: {
            "ys": tf.reduce_sum(tf.gather(v["params"], [0, 0, 2]) * v["w"]),
            "xs": [v["params"]],
        },
        "sparse_two_gathers": two_gathers,
    }


def _hess_cases(v: dict[str, Any]) -> dict[str, Callable[[], dict[str, Any]]]:
    """TF builders for ``hessians``."""

    def coupled() -> tf.Tensor:
        return tf.reduce_sum(tf.tanh(tf.linalg.matvec(v["w"], v["x"])) ** 2) + tf.reduce_sum(v["x"] ** 3)

    return {
        "hess_vector": lambda: {
            "ys": tf.reduce_sum(v["x"] ** 3 * tf.sin(v["x"]))
            + tf.tensordot(v["x"], tf.linalg.matvec(v["a"], v["x"]), 1),
            "xs": [v["x"]],
        },
        "hess_multi_xs": lambda: {"ys": coupled(), "xs": [v["x"], v["w"]]},
        "hess_multi_ys": lambda: {
            "ys": [tf.reduce_sum(tf.tanh(tf.linalg.matvec(v["w"], v["x"]))), v["x"] * v["x"] * v["x"]],
            "xs": [v["x"], v["w"]],
        },
        "hess_scalar_x": lambda: {"ys": v["x"] ** 4, "xs": [v["x"]]},
        "hess_linear": lambda: {"ys": tf.reduce_sum(3.0 * v["x"]), "xs": [v["x"]]},
    }


def _array(a: np.ndarray) -> dict[str, Any]:
    return {"shape": list(a.shape), "data": np.asarray(a, dtype=np.float64).ravel().tolist()}


def _result(value: Any) -> Any:
    if value is None:
        return None
    if hasattr(value, "indices"):  # a fetched IndexedSlices
        return {
            "indices": np.asarray(value.indices).tolist(),
            "values": _array(value.values),
            "dense_shape": np.asarray(value.dense_shape).tolist(),
        }
    return _array(value)


def _options(call: dict[str, Any]) -> dict[str, Any]:
    """The non-tensor options of a call, as JSON (an ``UnconnectedGradients`` member as its value)."""
    options = {}
    if "aggregation_method" in call:
        options["aggregation_method"] = int(call["aggregation_method"])
    if "unconnected_gradients" in call:
        mode = call["unconnected_gradients"]
        options["unconnected_gradients"] = str(getattr(mode, "value", mode))
    return options


def _inputs(case: str, dtype: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.uniform(-1.0, 1.0, size=s).astype(dtype) for k, s in SHAPES[case].items()}


def _run(fn: Callable[..., list[Any]], builders: Builders, case: str, dtype: str) -> dict[str, Any]:
    inputs = _inputs(case, dtype, seed=sorted(SHAPES).index(case) + 17 * DTYPES.index(dtype))
    graph = tf1.Graph()
    with graph.as_default():
        v = {k: tf1.constant(a) for k, a in inputs.items()}
        call = builders(v)[case]()
        record: dict[str, Any] = {
            "dtype": dtype,
            "inputs": {k: _array(a) for k, a in inputs.items()},
            "options": _options(call),
        }
        try:
            outputs = fn(**call)
        except ValueError as e:
            record["error"] = {"type": type(e).__name__, "message": str(e)}
            return record
        fetch = [o for o in outputs if o is not None]
        with tf1.Session(graph=graph) as sess:
            values = iter(sess.run(fetch))
        record["expected"] = [None if o is None else _result(next(values)) for o in outputs]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT})")
    out = parser.parse_args().out
    tf1.disable_eager_execution()
    out.mkdir(parents=True, exist_ok=True)
    jobs = {
        "tf_gradients.json": (tf1.gradients, _grad_cases, False),
        "tf_hessians.json": (tf1.hessians, _hess_cases, True),
    }
    for filename, (fn, builders, hessian) in jobs.items():
        names = [name for name in SHAPES if name.startswith("hess_") == hessian]
        cases = {f"{name}-{dtype}": _run(fn, builders, name, dtype) for name in names for dtype in DTYPES}
        payload = {"tensorflow": tf.__version__, "function": f"tf.compat.v1.{fn.__name__}", "cases": cases}
        (out / filename).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {out / filename}: {len(cases)} cases")


if __name__ == "__main__":
    main()
