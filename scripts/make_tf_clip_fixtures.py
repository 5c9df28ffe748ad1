"""Write the TensorFlow ground truth that tests/train/test_clip.py checks the clipping functions against.

Run with an interpreter that has TensorFlow (no torch needed)::

    python scripts/make_tf_clip_fixtures.py [--out tests/fixtures/train]

Every case calls one of ``tf.clip_by_global_norm``, ``tf.linalg.global_norm``,
``tf.clip_by_norm``, ``tf.clip_by_value`` or ``tf.nn.l2_loss`` (whose sum of
squares the norms are made of) eagerly on seeded inputs: lists
that are clipped and lists already inside the norm, all-zero tensors, an inf
and a NaN (TF turns every clipped tensor into NaN when the global norm is not
finite), ``None`` entries, ``IndexedSlices`` whose indices repeat, a given
``use_norm``, ``axes``, and float32 and float64.

The long inputs (up to 100003 elements, through every path of Eigen's sum) are
not stored: ``hashed`` makes them from integers, and ``clip.json`` names them
``hashed:<size>:<seed>``; only the outputs of those cases are stored. TF runs
on one intra-op thread (see below).

Output, deterministic: ``clip.json`` (``tf_version`` and ``cases``: ``id``,
``function``, ``kwargs``, ``dtype``, and the names of the input and output
arrays, ``None`` for a ``None`` entry) and ``clip.npz`` with the arrays under
``<case id>/<name>``. A sparse entry ``<name>`` is stored as ``<name>/values``,
``<name>/indices`` and ``<name>/dense_shape``.
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

# One intra-op thread: TF then sums a tensor in one order, Eigen's; on several threads it sums a large
# one in shards whose boundaries depend on the thread count.
tf.config.threading.set_intra_op_parallelism_threads(1)

SHAPES = ((4, 3), (5,), (2, 3, 4))


def dense_list(seed: int, scale: float, dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * scale).astype(dtype) for shape in SHAPES]


# Sizes that take every path of Eigen's sum: the tail alone, packets, blocks of four packets, and
# the pairwise split of more than 1024 packets (8192 float32, 4096 float64), more than once.
LONG_SIZES = (7, 31, 32, 100, 1000, 4095, 4097, 8191, 8192, 8193, 10000, 100003)


def hashed(size: int, seed: int, dtype: str) -> np.ndarray:
    """Values in [-3, 3) from integer hashing (exact in any numpy): the long inputs, not stored."""
    i = np.arange(size, dtype=np.uint64) + np.uint64(seed) * np.uint64(1_000_003)
    h = (i * np.uint64(2654435761)) % np.uint64(2**32)
    return (h.astype(np.float64) / 2**32 * 6 - 3).astype(dtype)


def sparse_entry(seed: int, dtype: str) -> dict[str, np.ndarray]:
    """Rows of a (6, 3) variable, index 2 three times and 0 twice: TF clips the values as given."""
    rng = np.random.default_rng(seed)
    indices = np.array([2, 0, 2, 5, 2, 0], dtype=np.int64)
    return {
        "values": (rng.standard_normal((len(indices), 3)) * 2).astype(dtype),
        "indices": indices,
        "dense_shape": np.array([6, 3], dtype=np.int64),
    }


def with_value(arrays: list[np.ndarray], index: tuple[int, ...], value: float) -> list[np.ndarray]:
    out = [a.copy() for a in arrays]
    out[0][index] = value
    return out


def build_cases() -> list[tuple[str, str, dict[str, Any], str, list[Any]]]:
    """(id, function, kwargs, dtype, inputs): an input is an array, a sparse dict, None, or
    ``("hashed", size, seed)``."""
    cases = []
    for dtype in ("float32", "float64"):
        big, small = dense_list(1, 3.0, dtype), dense_list(2, 0.05, dtype)
        zeros = [np.zeros(shape, dtype) for shape in SHAPES]
        cases += [
            (f"global_clipped_{dtype}", "clip_by_global_norm", {"clip_norm": 1.5}, dtype, big),
            (f"global_inside_{dtype}", "clip_by_global_norm", {"clip_norm": 3.0}, dtype, small),
            (f"global_zeros_{dtype}", "clip_by_global_norm", {"clip_norm": 1.0}, dtype, zeros),
            (
                f"global_inf_{dtype}",
                "clip_by_global_norm",
                {"clip_norm": 1.0},
                dtype,
                with_value(big, (1, 2), np.inf),
            ),
            (
                f"global_nan_{dtype}",
                "clip_by_global_norm",
                {"clip_norm": 1.0},
                dtype,
                with_value(big, (0, 0), np.nan),
            ),
            (
                f"global_none_sparse_{dtype}",
                "clip_by_global_norm",
                {"clip_norm": 2.0},
                dtype,
                [big[0], None, sparse_entry(3, dtype), big[2]],
            ),
            (
                f"global_use_norm_{dtype}",
                "clip_by_global_norm",
                {"clip_norm": 1.0, "use_norm": 7.25},
                dtype,
                big,
            ),
            (f"norm_{dtype}", "global_norm", {}, dtype, [big[0], None, sparse_entry(4, dtype), big[1]]),
            (f"norm_zeros_{dtype}", "global_norm", {}, dtype, zeros),
            (f"by_norm_{dtype}", "clip_by_norm", {"clip_norm": 2.0}, dtype, [big[0]]),
            (f"by_norm_inside_{dtype}", "clip_by_norm", {"clip_norm": 2.0}, dtype, [small[0]]),
            (f"by_norm_axes1_{dtype}", "clip_by_norm", {"clip_norm": 1.0, "axes": [1]}, dtype, [big[0]]),
            (f"by_norm_axes02_{dtype}", "clip_by_norm", {"clip_norm": 1.0, "axes": [0, 2]}, dtype, [big[2]]),
            (f"by_norm_zeros_{dtype}", "clip_by_norm", {"clip_norm": 1.0}, dtype, [zeros[0]]),
            (
                f"by_norm_inf_{dtype}",
                "clip_by_norm",
                {"clip_norm": 1.0},
                dtype,
                [with_value(big, (1, 2), np.inf)[0]],
            ),
            (
                f"by_norm_nan_{dtype}",
                "clip_by_norm",
                {"clip_norm": 1.0},
                dtype,
                [with_value(big, (1, 2), np.nan)[0]],
            ),
            (f"by_norm_sparse_{dtype}", "clip_by_norm", {"clip_norm": 1.0}, dtype, [sparse_entry(5, dtype)]),
            (
                f"by_value_{dtype}",
                "clip_by_value",
                {"clip_value_min": -0.5, "clip_value_max": 1.25},
                dtype,
                [with_value(with_value(big, (0, 0), np.nan), (1, 1), -np.inf)[0]],
            ),
            (
                f"by_value_sparse_{dtype}",
                "clip_by_value",
                {"clip_value_min": -1.0, "clip_value_max": 0.5},
                dtype,
                [sparse_entry(6, dtype)],
            ),
        ]
        long = [("hashed", size, seed) for seed, size in enumerate(LONG_SIZES)]
        cases += [
            (f"norm_long_{dtype}", "global_norm", {}, dtype, long),
            # 40 tensors: their l2_loss halves are summed in Eigen's blocks of four packets too.
            (
                f"norm_many_{dtype}",
                "global_norm",
                {},
                dtype,
                [("hashed", 3 + i % 5, 100 + i) for i in range(40)],
            ),
            # Each tensor's l2_loss alone: Eigen's sum of squares, bit for bit before a square root.
            (f"l2_loss_long_{dtype}", "l2_loss", {}, dtype, long),
            (
                f"by_norm_long_{dtype}",
                "clip_by_norm",
                {"clip_norm": 10.0},
                dtype,
                [long[LONG_SIZES.index(10000)]],
            ),
        ]
    return cases


def to_tf(entry: Any, dtype: str) -> Any:
    if entry is None:
        return None
    if isinstance(entry, tuple):
        _, size, seed = entry
        return tf.constant(hashed(size, seed, dtype))
    if isinstance(entry, dict):
        return tf.IndexedSlices(
            tf.constant(entry["values"]), tf.constant(entry["indices"]), tf.constant(entry["dense_shape"])
        )
    return tf.constant(entry)


def from_tf(result: Any) -> Any:
    if result is None:
        return None
    if isinstance(result, tf.IndexedSlices):
        return {
            "values": result.values.numpy(),
            "indices": result.indices.numpy(),
            "dense_shape": result.dense_shape.numpy(),
        }
    return result.numpy()


def run(function: str, kwargs: dict[str, Any], dtype: str, inputs: list[Any]) -> list[Any]:
    tensors = [to_tf(entry, dtype) for entry in inputs]
    if function == "clip_by_global_norm":
        kwargs = dict(kwargs)
        if "use_norm" in kwargs:
            kwargs["use_norm"] = tf.constant(kwargs["use_norm"], dtype=dtype)
        clipped, norm = tf.clip_by_global_norm(tensors, **kwargs)
        return [from_tf(c) for c in clipped] + [norm.numpy()]
    if function == "global_norm":
        return [tf.linalg.global_norm(tensors).numpy()]
    if function == "l2_loss":
        return [tf.nn.l2_loss(t).numpy() for t in tensors]
    return [from_tf(getattr(tf, function)(tensors[0], **kwargs))]


def store(arrays: dict[str, np.ndarray], prefix: str, entries: list[Any]) -> list[str | None]:
    names: list[str | None] = []
    for i, entry in enumerate(entries):
        if entry is None:
            names.append(None)
            continue
        if isinstance(entry, tuple):
            names.append(":".join(map(str, entry)))
            continue
        name = f"{prefix}{i}"
        if isinstance(entry, dict):
            for key, value in entry.items():
                arrays[f"{name}/{key}"] = value
        else:
            arrays[name] = np.asarray(entry)
        names.append(name)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/train"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest, arrays = [], {}
    for case_id, function, kwargs, dtype, inputs in build_cases():
        outputs = run(function, kwargs, dtype, inputs)
        case_arrays: dict[str, np.ndarray] = {}
        entry = {
            "id": case_id,
            "function": function,
            "kwargs": kwargs,
            "dtype": dtype,
            "inputs": store(case_arrays, "in", inputs),
            "outputs": store(case_arrays, "out", outputs),
            "sparse": sorted({n.split("/")[0] for n in case_arrays if "/" in n}),
        }
        arrays.update({f"{case_id}/{k}": v for k, v in case_arrays.items()})
        manifest.append(entry)
    (args.out / "clip.json").write_text(
        json.dumps({"tf_version": tf.__version__, "cases": manifest}, indent=1) + "\n"
    )
    np.savez_compressed(args.out / "clip.npz", **arrays)
    print(f"wrote {len(manifest)} cases to {args.out}")


if __name__ == "__main__":
    main()
