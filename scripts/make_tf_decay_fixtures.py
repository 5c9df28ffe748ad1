"""Write the TF ground truth that tests/train/test_lr_decay.py checks the learning-rate decays against.

Run with an interpreter that has TensorFlow (no torch needed)::

    python scripts/make_tf_decay_fixtures.py [--out tests/fixtures/train]

Every case evaluates a ``tf.compat.v1.train.*_decay`` eagerly, as TF 2 runs it:
the decay is made once with an int64 ``tf.Variable`` global step, and the
returned callable is called after each ``global_step.assign(step)``, at steps 0
to 11, around every multiple of the decay period up to the fourth, and at large
steps up to past 10**8 (float32 holds every integer only up to 2**24). A case
named ``bert_warmup`` runs BERT's ``create_optimizer`` learning-rate code (a
polynomial decay under a linear warm-up) verbatim, at steps below 2**31 (it
casts the step to int32).

``noisy_linear_cosine_decay`` draws from TF's random op, which torch cannot
reproduce: its cases either have ``initial_variance=0`` (no noise) or replace
the standard normal draw by a recorded number per step (``noise``), keeping TF's
``rnd * stddev + mean`` and the rest of its arithmetic.

The same cases, and ``GRAPH_CASES``, also run in a TF1 graph, as a TF1
training loop runs them: ``get_or_create_global_step()`` (an int64 variable)
assigned before each ``Session.run`` of the decay's tensor, in a ``Session``
with the default config, so Grappler rewrites the graph (its constant folding
turns a division by a constant into a product with its reciprocal, among
others). The noise there is a fed placeholder in place of TF's random op.

Output, deterministic: ``decays.json`` (eager) and ``decays_graph.json``
(graph), each with ``tf_version`` and ``cases``, each with ``id``,
``function``, ``kwargs`` (TF's argument names, the step argument left out),
``steps``, ``bits`` (the float32 learning rate at each step, as its uint32 bit
pattern) and, for injected noise, ``noise`` (float32 bit patterns).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

# Quiet TF's start-up logging, and keep oneDNN rewrites out of the numbers.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
from tensorflow.python.ops import gen_random_ops

LARGE_STEPS = (
    999_999,
    1_000_000,
    2**24 - 1,
    2**24,
    2**24 + 1,
    2**24 + 3,
    10_000_001,
    33_554_435,
    99_999_999,
    100_000_000,
    100_000_001,
    123_456_789,
    3_000_000_001,
)

# (id, function, kwargs without the step, decay period for the steps around its multiples)
CASES: tuple[tuple[str, str, dict[str, Any], int], ...] = (
    ("exp_1000", "exponential_decay", {"learning_rate": 0.1, "decay_steps": 1000, "decay_rate": 0.96}, 1000),
    (
        "exp_1000_stair",
        "exponential_decay",
        {"learning_rate": 0.1, "decay_steps": 1000, "decay_rate": 0.96, "staircase": True},
        1000,
    ),
    # Underflows to subnormals, which TF flushes to zero.
    ("exp_37_half", "exponential_decay", {"learning_rate": 0.01, "decay_steps": 37, "decay_rate": 0.5}, 37),
    (
        "exp_37_half_stair",
        "exponential_decay",
        {"learning_rate": 0.01, "decay_steps": 37, "decay_rate": 0.5, "staircase": True},
        37,
    ),
    # EfficientNet's: decay_steps = steps_per_epoch * 2.4, a float.
    (
        "exp_efficientnet",
        "exponential_decay",
        {"learning_rate": 0.016, "decay_steps": 1251 * 2.4, "decay_rate": 0.97, "staircase": True},
        3002,
    ),
    (
        "natexp_1000",
        "natural_exp_decay",
        {"learning_rate": 0.1, "decay_steps": 1000, "decay_rate": 0.5},
        1000,
    ),
    (
        "natexp_7_stair",
        "natural_exp_decay",
        {"learning_rate": 0.3, "decay_steps": 7, "decay_rate": 0.05, "staircase": True},
        7,
    ),
    ("natexp_7", "natural_exp_decay", {"learning_rate": 0.3, "decay_steps": 7, "decay_rate": 0.05}, 7),
    ("inv_1000", "inverse_time_decay", {"learning_rate": 0.1, "decay_steps": 1000, "decay_rate": 0.5}, 1000),
    (
        "inv_13_stair",
        "inverse_time_decay",
        {"learning_rate": 0.2, "decay_steps": 13, "decay_rate": 2.0, "staircase": True},
        13,
    ),
    ("inv_13", "inverse_time_decay", {"learning_rate": 0.2, "decay_steps": 13, "decay_rate": 2.0}, 13),
    ("poly_1000", "polynomial_decay", {"learning_rate": 0.1, "decay_steps": 1000}, 1000),
    ("poly_1000_cycle", "polynomial_decay", {"learning_rate": 0.1, "decay_steps": 1000, "cycle": True}, 1000),
    (
        "poly_777_pow2",
        "polynomial_decay",
        {"learning_rate": 0.1, "decay_steps": 777, "end_learning_rate": 0.01, "power": 2.0},
        777,
    ),
    (
        "poly_777_pow2_cycle",
        "polynomial_decay",
        {"learning_rate": 0.1, "decay_steps": 777, "end_learning_rate": 0.01, "power": 2.0, "cycle": True},
        777,
    ),
    (
        "poly_50_sqrt_cycle",
        "polynomial_decay",
        {"learning_rate": 0.3, "decay_steps": 50, "end_learning_rate": 0.0, "power": 0.5, "cycle": True},
        50,
    ),
    (
        "piecewise_3",
        "piecewise_constant",
        {"boundaries": [1000, 5000, 10000], "values": [0.1, 0.05, 0.01, 0.001]},
        1000,
    ),
    ("piecewise_1", "piecewise_constant", {"boundaries": [100000], "values": [1.0, 0.5]}, 100000),
    ("cos_1000", "cosine_decay", {"learning_rate": 0.1, "decay_steps": 1000}, 1000),
    ("cos_1000_alpha", "cosine_decay", {"learning_rate": 0.1, "decay_steps": 1000, "alpha": 0.1}, 1000),
    ("cos_37_alpha", "cosine_decay", {"learning_rate": 0.4, "decay_steps": 37, "alpha": 0.05}, 37),
    ("sgdr_1000", "cosine_decay_restarts", {"learning_rate": 0.1, "first_decay_steps": 1000}, 1000),
    (
        "sgdr_100_tmul1",
        "cosine_decay_restarts",
        {"learning_rate": 0.1, "first_decay_steps": 100, "t_mul": 1.0, "m_mul": 0.9, "alpha": 0.1},
        100,
    ),
    (
        "sgdr_37_tmul1.5",
        "cosine_decay_restarts",
        {"learning_rate": 0.2, "first_decay_steps": 37, "t_mul": 1.5, "m_mul": 0.8},
        37,
    ),
    # Periods that shrink: NaN once their sum (100 steps) is past.
    (
        "sgdr_50_tmul0.5",
        "cosine_decay_restarts",
        {"learning_rate": 0.1, "first_decay_steps": 50, "t_mul": 0.5},
        50,
    ),
    ("lincos_1000", "linear_cosine_decay", {"learning_rate": 0.1, "decay_steps": 1000}, 1000),
    (
        "lincos_1000_2periods",
        "linear_cosine_decay",
        {"learning_rate": 0.1, "decay_steps": 1000, "num_periods": 2.0, "alpha": 0.1, "beta": 0.01},
        1000,
    ),
    (
        "lincos_37",
        "linear_cosine_decay",
        {"learning_rate": 0.3, "decay_steps": 37, "num_periods": 1.5, "beta": 0.0},
        37,
    ),
    (
        "noisy_1000_novariance",
        "noisy_linear_cosine_decay",
        {"learning_rate": 0.1, "decay_steps": 1000, "initial_variance": 0.0},
        1000,
    ),
    ("noisy_1000", "noisy_linear_cosine_decay", {"learning_rate": 0.1, "decay_steps": 1000}, 1000),
    (
        "noisy_37",
        "noisy_linear_cosine_decay",
        {
            "learning_rate": 0.2,
            "decay_steps": 37,
            "initial_variance": 0.5,
            "variance_decay": 0.3,
            "num_periods": 1.5,
            "alpha": 0.1,
            "beta": 0.01,
        },
        37,
    ),
    (
        "bert_warmup",
        "bert_warmup",
        {"init_lr": 5e-5, "num_train_steps": 10000, "num_warmup_steps": 1000},
        1000,
    ),
    (
        "bert_warmup_large",
        "bert_warmup",
        {"init_lr": 1e-4, "num_train_steps": 1_000_000, "num_warmup_steps": 10000},
        10000,
    ),
)

# Steps where 0.01 * 0.5 ** (step / 37) is subnormal in float32 (steps 4417 to 5303; 4440 to 5327
# with staircase), which TF flushes to zero: the product, and from step 4662 the power too.
EXTRA_STEPS = {
    "exp_37_half": (4420, 4426, 4427, 4500, 4661, 4662, 5000, 5270, 5271, 5300),
    "exp_37_half_stair": (4420, 4440, 4441, 4500, 4661, 4662, 5000, 5254, 5255, 5300),
}

# Standard normal numbers recorded in place of TF's random op, one per step.
NOISE_SEED = 40

# Graph mode only: the configurations whose graph Grappler rewrites another way (a zero alpha,
# beta or end rate drops a term and lets the learning rate fold into a constant; a power of 0,
# 0.5, 2 or 3 becomes other ops), and staircases whose boundary moves: x * (1/41) at x = 41 is
# just below 1 in float32, so the graph's floor is 0 there (a step late).
GRAPH_CASES: tuple[tuple[str, str, dict[str, Any], int], ...] = (
    (
        "exp_41_stair",
        "exponential_decay",
        {"learning_rate": 0.1, "decay_steps": 41, "decay_rate": 0.5, "staircase": True},
        41,
    ),
    (
        "natexp_41_stair",
        "natural_exp_decay",
        {"learning_rate": 0.1, "decay_steps": 41, "decay_rate": 0.5, "staircase": True},
        41,
    ),
    (
        "inv_41_stair",
        "inverse_time_decay",
        {"learning_rate": 0.1, "decay_steps": 41, "decay_rate": 1.0, "staircase": True},
        41,
    ),
    ("inv_41", "inverse_time_decay", {"learning_rate": 0.1, "decay_steps": 41, "decay_rate": 0.3}, 41),
    (
        "sgdr_41_tmul1",
        "cosine_decay_restarts",
        {"learning_rate": 0.1, "first_decay_steps": 41, "t_mul": 1.0, "m_mul": 0.5},
        41,
    ),
    (
        "sgdr_37_tmul1.5_alpha",
        "cosine_decay_restarts",
        {"learning_rate": 0.2, "first_decay_steps": 37, "t_mul": 1.5, "m_mul": 0.8, "alpha": 0.05},
        37,
    ),
    (
        "poly_41_pow3",
        "polynomial_decay",
        {"learning_rate": 0.1, "decay_steps": 41, "end_learning_rate": 0.001, "power": 3.0},
        41,
    ),
    (
        "poly_41_pow0",
        "polynomial_decay",
        {"learning_rate": 0.1, "decay_steps": 41, "end_learning_rate": 0.001, "power": 0.0},
        41,
    ),
    (
        "poly_41_sqrt",
        "polynomial_decay",
        {"learning_rate": 0.1, "decay_steps": 41, "end_learning_rate": 0.001, "power": 0.5},
        41,
    ),
    (
        "poly_41_pow1.5_cycle",
        "polynomial_decay",
        {"learning_rate": 0.1, "decay_steps": 41, "power": 1.5, "cycle": True},
        41,
    ),
    ("cos_41_lr1", "cosine_decay", {"learning_rate": 1.0, "decay_steps": 41}, 41),
    (
        "lincos_37_alpha_nobeta",
        "linear_cosine_decay",
        {"learning_rate": 0.3, "decay_steps": 37, "alpha": 0.1, "beta": 0.0},
        37,
    ),
    (
        "lincos_37_lr1_nobeta",
        "linear_cosine_decay",
        {"learning_rate": 1.0, "decay_steps": 37, "num_periods": 1.5, "beta": 0.0},
        37,
    ),
    (
        "noisy_37_nobeta",
        "noisy_linear_cosine_decay",
        {"learning_rate": 0.2, "decay_steps": 37, "initial_variance": 0.5, "beta": 0.0},
        37,
    ),
    (
        "noisy_37_alpha_nobeta",
        "noisy_linear_cosine_decay",
        {"learning_rate": 0.2, "decay_steps": 37, "initial_variance": 0.5, "alpha": 0.1, "beta": 0.0},
        37,
    ),
    (
        "bert_warmup_7",
        "bert_warmup",
        {"init_lr": 0.1, "num_train_steps": 100, "num_warmup_steps": 7},
        7,
    ),
)


def steps_for(period: int) -> list[int]:
    """0-11, around the first four multiples of ``period`` and its half, and the large steps."""
    steps = set(range(12)) | {period // 2}
    for k in range(1, 5):
        steps |= {k * period + d for d in (-2, -1, 0, 1, 2)}
    return sorted(s for s in steps | set(LARGE_STEPS) if s >= 0)


def bert_learning_rate(global_step: tf.Variable, init_lr: float, num_train_steps: int, num_warmup_steps: int):
    """BERT's optimization.create_optimizer, its learning-rate lines as written (TF1, graph-style ops)."""
    learning_rate = tf.constant(value=init_lr, shape=[], dtype=tf.float32)
    learning_rate = tf.compat.v1.train.polynomial_decay(
        learning_rate, global_step, num_train_steps, end_learning_rate=0.0, power=1.0, cycle=False
    )

    def value():
        # A callable in eager mode, the tensor itself in a graph.
        decayed = learning_rate() if callable(learning_rate) else learning_rate
        global_steps_int = tf.cast(global_step, tf.int32)
        warmup_steps_int = tf.constant(num_warmup_steps, dtype=tf.int32)
        global_steps_float = tf.cast(global_steps_int, tf.float32)
        warmup_steps_float = tf.cast(warmup_steps_int, tf.float32)
        warmup_percent_done = global_steps_float / warmup_steps_float
        warmup_learning_rate = init_lr * warmup_percent_done
        is_warmup = tf.cast(global_steps_int < warmup_steps_int, tf.float32)
        return (1.0 - is_warmup) * decayed + is_warmup * warmup_learning_rate

    return value


def bits(values: list[np.float32]) -> list[int]:
    return [int(v) for v in np.asarray(values, dtype=np.float32).view(np.uint32)]


def noise_for(function: str, kwargs: dict[str, Any], count: int) -> np.ndarray | None:
    """The recorded standard normal numbers that replace TF's draw, or None where there is no noise."""
    if function != "noisy_linear_cosine_decay" or kwargs.get("initial_variance", 1.0) == 0:
        return None
    return np.random.default_rng(NOISE_SEED).standard_normal(count).astype(np.float32)


def case_steps(case_id: str, function: str, period: int) -> list[int]:
    steps = sorted(set(steps_for(period)) | set(EXTRA_STEPS.get(case_id, ())))
    if function == "bert_warmup":
        # BERT casts the step to int32, which wraps past 2**31 - 1 (into its warm-up, negative).
        steps = [s for s in steps if s < 2**31]
    return steps


def graph_case(case_id: str, function: str, kwargs: dict[str, Any], period: int) -> dict[str, Any]:
    """A graph-only case: its steps, and its recorded noise as bit patterns."""
    steps = case_steps(case_id, function, period)
    case = {"id": case_id, "function": function, "kwargs": kwargs, "steps": steps}
    noise = noise_for(function, kwargs, len(steps))
    if noise is not None:
        case["noise"] = bits(list(noise))
    return case


def run_case(function: str, kwargs: dict[str, Any], steps: list[int]) -> dict[str, Any]:
    global_step = tf.Variable(0, dtype=tf.int64)
    if function == "bert_warmup":
        decayed = bert_learning_rate(global_step, **kwargs)
    elif function == "piecewise_constant":
        decayed = tf.compat.v1.train.piecewise_constant(global_step, **kwargs)
    else:
        decayed = getattr(tf.compat.v1.train, function)(global_step=global_step, **kwargs)
    noise = noise_for(function, kwargs, len(steps))
    values = []
    real_draw = gen_random_ops.random_standard_normal
    try:
        for i, step in enumerate(steps):
            if noise is not None:
                z = noise[i]
                gen_random_ops.random_standard_normal = lambda shape, dtype, z=z, **_: tf.fill(shape, z)
            global_step.assign(step)
            value = decayed()
            assert value.dtype == tf.float32, value.dtype
            values.append(value.numpy())
    finally:
        gen_random_ops.random_standard_normal = real_draw
    case = {"steps": steps, "bits": bits(values)}
    if noise is not None:
        case["noise"] = bits(list(noise))
    return case


def run_graph_case(function: str, kwargs: dict[str, Any], steps: list[int], noise: Any) -> list[int]:
    """The decay in a TF1 graph run by a ``Session`` with the default config (Grappler on)."""
    graph = tf.Graph()
    with graph.as_default():
        global_step = tf.compat.v1.train.get_or_create_global_step()
        step_feed = tf.compat.v1.placeholder(tf.int64, [])
        set_step = global_step.assign(step_feed)
        # The draw becomes a fed placeholder: like TF's random op, not a constant to Grappler.
        draw = tf.compat.v1.placeholder(tf.float32, [])
        real_draw = gen_random_ops.random_standard_normal
        gen_random_ops.random_standard_normal = lambda shape, dtype, **_: tf.fill(shape, draw)
        try:
            if function == "bert_warmup":
                learning_rate = bert_learning_rate(global_step, **kwargs)()
            elif function == "piecewise_constant":
                learning_rate = tf.compat.v1.train.piecewise_constant(global_step, **kwargs)
            else:
                learning_rate = getattr(tf.compat.v1.train, function)(global_step=global_step, **kwargs)
        finally:
            gen_random_ops.random_standard_normal = real_draw
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    values = []
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        for i, step in enumerate(steps):
            sess.run(set_step, {step_feed: step})
            values.append(sess.run(learning_rate, {draw: 0.0 if noise is None else noise[i]}))
    return bits(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/train"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = []
    for case_id, function, kwargs, period in CASES:
        case = run_case(function, kwargs, case_steps(case_id, function, period))
        cases.append({"id": case_id, "function": function, "kwargs": kwargs, **case})
    fixture = {"tf_version": tf.__version__, "cases": cases}
    (args.out / "decays.json").write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out / 'decays.json'}")

    graph_cases = []
    for case in cases + [graph_case(*spec) for spec in GRAPH_CASES]:
        noise = np.asarray(case["noise"], np.uint32).view(np.float32) if "noise" in case else None
        graph_bits = run_graph_case(case["function"], case["kwargs"], case["steps"], noise)
        graph_cases.append({**case, "bits": graph_bits})
    fixture = {"tf_version": tf.__version__, "cases": graph_cases}
    (args.out / "decays_graph.json").write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {len(graph_cases)} cases to {args.out / 'decays_graph.json'}")


if __name__ == "__main__":
    main()
