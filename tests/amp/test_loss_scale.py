"""The loss-scale state machines against real TensorFlow, torch.amp.GradScaler, and their contracts.

tests/fixtures/amp/tf_loss_scale.json was written by
scripts/make_tf_loss_scale_fixtures.py: ``tf.compat.v1.mixed_precision``'s
``DynamicLossScale`` and ``FixedLossScale`` driven through sequences of
``update(grads)``; every step records the scale, the good-step counter and
``should_apply_gradients``. They are compared exactly: the scale is a float32
state machine and must match TF bit for bit.
"""

from __future__ import annotations

import copy
import io
import json
import math
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from torchgrad_compat.amp import DynamicLossScale, FixedLossScale, LossScale
from torchgrad_compat.amp.loss_scale import as_loss_scale, found_non_finite

FIXTURES = Path(__file__).parents[1] / "fixtures" / "amp"
GENERATOR = Path(__file__).parents[2] / "scripts" / "make_tf_loss_scale_fixtures.py"
SEQUENCES: list[dict[str, Any]] = json.loads((FIXTURES / "tf_loss_scale.json").read_text())["cases"]
NAN, INF = math.nan, math.inf
FLOAT32_MAX = torch.finfo(torch.float32).max
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# The generator's gradient tokens: a vector [1, x, 0.5], or a (3, 2) sparse gradient
# with values [[1, -2], [0.5, x]] at rows [0, 2].
TOKENS = {
    "finite": 3.0,
    "huge": 3e38,
    "inf": INF,
    "-inf": -INF,
    "nan": NAN,
    "sparse": 3.0,
    "sparse-inf": INF,
    "sparse-nan": NAN,
}


def make_grad(token: str | None) -> Tensor | None:
    if token is None:
        return None
    x = TOKENS[token]
    if token.startswith("sparse"):
        values = torch.tensor([[1.0, -2.0], [0.5, x]])
        return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (3, 2), check_invariants=True)
    return torch.tensor([1.0, x, 0.5])


def make_loss_scale(case: dict[str, Any]) -> LossScale:
    return {"DynamicLossScale": DynamicLossScale, "FixedLossScale": FixedLossScale}[case["class"]](
        **case["kwargs"]
    )


def trace(loss_scale: LossScale, steps: list[list[str | None]]) -> list[tuple[bool, float, int | None]]:
    out = []
    for step in steps:
        applied = loss_scale.update([make_grad(t) for t in step])
        good = int(loss_scale.good_steps) if isinstance(loss_scale, DynamicLossScale) else None
        out.append((applied, float(loss_scale()), good))
    return out


def tf_trace(case: dict[str, Any]) -> list[tuple[bool, float, int | None]]:
    return [(t["should_apply"], t["scale"], t.get("good_steps")) for t in case["trace"]]


# ---------------------------------------------------------------------- TensorFlow parity
@pytest.mark.parametrize("case", SEQUENCES, ids=[c["id"] for c in SEQUENCES])
def test_sequence_matches_tensorflow(case: dict[str, Any]) -> None:
    loss_scale = make_loss_scale(case)
    assert float(loss_scale()) == case["initial_scale"]
    assert trace(loss_scale, case["steps"]) == tf_trace(case)


@pytest.mark.parametrize("case", SEQUENCES, ids=[c["id"] for c in SEQUENCES])
def test_config_matches_tensorflow_and_round_trips(case: dict[str, Any]) -> None:
    loss_scale = make_loss_scale(case)
    assert loss_scale.get_config() == case["get_config"]
    rebuilt = type(loss_scale).from_config(loss_scale.get_config())
    assert rebuilt.get_config() == case["get_config"]
    assert trace(rebuilt, case["steps"]) == tf_trace(case)


def test_fixtures_cover_the_rules() -> None:
    """The TF sequences exercise growth, backoff, the floor, the overflow cap and counter resets."""
    ids = {c["id"] for c in SEQUENCES}
    assert {"grow", "backoff", "floor", "floor-raises-below-one", "nonfinite-resets-counter"} <= ids
    assert {"cap-power-of-two", "cap-inexact", "multiplier-3-inexact", "mix", "fixed"} <= ids
    floor = next(c for c in SEQUENCES if c["id"] == "floor-raises-below-one")
    assert floor["initial_scale"] == 0.5 and floor["trace"][0]["scale"] == 1.0
    cap = next(c for c in SEQUENCES if c["id"] == "cap-power-of-two")
    assert cap["trace"][-1] == {"scale": 2.0**127, "good_steps": 0, "should_apply": True}


def test_update_from_found_inf_stays_on_device() -> None:
    """The state machine returns a tensor: deciding (a host sync) is the caller's one sync."""
    loss_scale = DynamicLossScale(initial_loss_scale=8, increment_period=1)
    applied = loss_scale.update_from_found_inf(torch.ones(1))
    assert isinstance(applied, Tensor) and applied.dtype == torch.bool and applied.dim() == 0
    assert not applied and float(loss_scale()) == 4.0
    assert loss_scale.variables()[0].dtype == torch.float32
    assert loss_scale.variables()[1].dtype == torch.int64


def test_call_returns_a_snapshot() -> None:
    loss_scale = DynamicLossScale(initial_loss_scale=8, increment_period=1)
    before = loss_scale()
    loss_scale.update([torch.ones(1)])
    assert float(before) == 8.0 and float(loss_scale()) == 16.0


# ---------------------------------------------------------------------- torch.amp.GradScaler
def test_matches_grad_scaler_away_from_the_floor() -> None:
    """With growth 2 / backoff 0.5 and a scale that stays above 1, TF's rule is GradScaler's update."""
    gen = torch.Generator().manual_seed(0)
    flags = (torch.rand(200, generator=gen) < 0.2).tolist()
    ours = DynamicLossScale(initial_loss_scale=2.0**20, increment_period=3)
    scale, tracker = torch.tensor(2.0**20), torch.zeros((), dtype=torch.int32)
    for found in flags:
        found_inf = torch.tensor([float(found)])
        ours.update_from_found_inf(found_inf)
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 3)
        assert float(ours()) == float(scale) and int(ours.good_steps) == int(tracker)
    assert float(scale) > 1.0


def test_differs_from_grad_scaler_at_the_floor() -> None:
    ours = DynamicLossScale(initial_loss_scale=2.0, increment_period=3)
    scale, tracker = torch.tensor(2.0), torch.zeros((), dtype=torch.int32)
    for _ in range(3):
        ours.update_from_found_inf(torch.ones(1))
        torch._amp_update_scale_(scale, tracker, torch.ones(1), 2.0, 0.5, 3)
    assert float(ours()) == 1.0  # TF: never below 1
    assert float(scale) == 0.25  # GradScaler: no floor


def _tf_update(
    scale: float, good: int, found: bool, multiplier: float, period: int
) -> tuple[float, int, bool]:
    """TF's DynamicLossScale.update on one step, in float32 (struct rounds each result to float32)."""

    def f32(x: float) -> float:
        try:
            return struct.unpack("f", struct.pack("f", x))[0]
        except OverflowError:  # a product past float32's range
            return math.inf

    m = f32(multiplier)
    if found:
        return max(f32(scale / m), 1.0), 0, False
    if good + 1 >= period:
        grown = f32(scale * m)
        return (grown if math.isfinite(grown) else scale), 0, True
    return scale, good + 1, True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("multiplier", [2.0, 4.0, 2.0**10, 3.0, 1.5])
@pytest.mark.parametrize(
    ("initial", "period", "loaded_good"),
    [
        (2.0**15, 2, 0),
        (0.5, 1, 0),
        (2.0, 3, 7),
        (FLOAT32_MAX / 2, 2, 1),
        (2.0**-126, 3, 2),
        (3.0, 2000, 1999),
    ],
    ids=["usual", "below-one", "counter-past-period", "overflow", "tiny", "tf-default"],
)
def test_every_update_is_tf_rule(
    device: str, multiplier: float, initial: float, period: int, loaded_good: int
) -> None:
    """Scale, counter and decision after each of 60 random steps, bit for bit TF's rule in float32.

    With a power-of-two multiplier the update runs as GradScaler's one kernel with a floor and a
    capped counter around it; the other multipliers take TF's operations one by one.
    """
    loss_scale = DynamicLossScale(initial_loss_scale=2.0, increment_period=period, multiplier=multiplier)
    state = loss_scale.state_dict()
    state.update(current_loss_scale=torch.tensor(initial), good_steps=torch.tensor(loaded_good))
    loss_scale.load_state_dict(state)
    loss_scale.to(device)
    gen = torch.Generator().manual_seed(period)
    flags = (torch.rand(60, generator=gen) < 0.3).tolist()
    flags[0] = False  # a finite first step: a loaded counter past the period grows at once
    scale, good = float(torch.tensor(initial)), loaded_good
    for step, found in enumerate(flags):
        scale, good, apply = _tf_update(scale, good, found, multiplier, period)
        applied = loss_scale.update_from_found_inf(torch.tensor([float(found)], device=device))
        got = (float(loss_scale()), int(loss_scale.good_steps), bool(applied))
        assert got == (scale, good, apply), f"step {step}"
    assert loss_scale.variables()[1].dtype == torch.int64


def test_an_update_under_inference_mode_leaves_later_updates_working() -> None:
    """The scale's state stays ordinary tensors: an update inside ``torch.inference_mode()``
    (an evaluation loop that steps) does not make the next one, outside it, raise."""
    loss_scale = DynamicLossScale(initial_loss_scale=4, increment_period=1)
    with torch.inference_mode():
        assert loss_scale.update([torch.ones(2)])
    assert loss_scale.update([torch.ones(2)])
    assert not loss_scale.update([torch.tensor([math.inf])])
    assert (float(loss_scale()), int(loss_scale.good_steps)) == (8.0, 0)
    assert not any(t.is_inference() for t in loss_scale.variables())


def test_never_overflows() -> None:
    """From 1e38 with multiplier 16 the scale stays finite (GradScaler's and TF's capped test)."""
    loss_scale = DynamicLossScale(initial_loss_scale=1e38, increment_period=1, multiplier=16.0)
    for _ in range(10):
        loss_scale.update([torch.ones(3)])
        assert 0 < float(loss_scale()) <= FLOAT32_MAX
        assert int(loss_scale.good_steps) == 0


# ---------------------------------------------------------------------- the non-finite check
def test_found_non_finite_reads_values_only() -> None:
    dense = torch.tensor([1.0, 2.0])
    assert float(found_non_finite([None, dense, torch.empty(0)], "cpu")) == 0.0
    assert float(found_non_finite([], "cpu")) == 0.0
    for bad in (INF, -INF, NAN):
        grads = [dense, torch.tensor([[0.0, bad]], dtype=torch.bfloat16)]
        assert float(found_non_finite(grads, "cpu")) == 1.0
    assert torch.equal(dense, torch.tensor([1.0, 2.0]))
    # The largest finite value is finite: the check must not sum.
    assert float(found_non_finite([torch.full((4,), FLOAT32_MAX)], "cpu")) == 0.0


def test_found_non_finite_float16_sparse_sum_overflow() -> None:
    """Uncoalesced float16 rows whose sum overflows are non-finite (GradScaler's sparse test)."""
    indices = torch.tensor([[0, 0]])
    half = torch.float16
    overflowing = torch.sparse_coo_tensor(
        indices, torch.tensor([64000.0, 64000.0], dtype=half), (2,), check_invariants=True
    )
    fitting = torch.sparse_coo_tensor(
        indices, torch.tensor([32000.0, 32000.0], dtype=half), (2,), check_invariants=True
    )
    assert not overflowing.is_coalesced()
    assert float(found_non_finite([overflowing], "cpu")) == 1.0
    assert float(found_non_finite([fitting], "cpu")) == 0.0
    with_nan = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([NAN]), (2,), check_invariants=True)
    assert float(found_non_finite([with_nan], "cpu")) == 1.0


def test_fixed_never_looks_at_gradients() -> None:
    """TF's FixedLossScale says "apply" even for NaN, and never changes."""
    loss_scale = FixedLossScale(128)
    assert loss_scale.update([torch.tensor([NAN])]) is True
    assert loss_scale.update(["not even a tensor"]) is True
    assert float(loss_scale()) == 128.0 and loss_scale.variables() == []


# ---------------------------------------------------------------------- construction and errors
def test_defaults_and_identifiers() -> None:
    dynamic = as_loss_scale("dynamic")
    assert isinstance(dynamic, DynamicLossScale)
    assert dynamic.get_config() == {
        "initial_loss_scale": 32768.0,
        "increment_period": 2000,
        "multiplier": 2.0,
    }
    assert float(dynamic()) == 2.0**15 and int(dynamic.good_steps) == 0
    fixed = as_loss_scale(64)
    assert isinstance(fixed, FixedLossScale) and float(fixed()) == 64.0
    assert as_loss_scale(fixed) is fixed


BAD_ARGUMENTS = [
    # (factory, exception, words the message must contain)
    (lambda: as_loss_scale(None), ValueError, "loss_scale cannot be None"),
    (lambda: as_loss_scale("Dynamic"), ValueError, "loss_scale"),
    (lambda: as_loss_scale(0.5), ValueError, "loss_scale"),
    (lambda: as_loss_scale(NAN), ValueError, "loss_scale"),
    (lambda: as_loss_scale(True), TypeError, "loss_scale"),
    (lambda: as_loss_scale([2.0]), TypeError, "loss_scale"),
    (lambda: as_loss_scale(torch.tensor(2.0)), TypeError, "loss_scale"),
    (lambda: FixedLossScale(0.5), ValueError, "loss_scale_value"),
    (lambda: FixedLossScale(INF), ValueError, "loss_scale_value"),
    (lambda: FixedLossScale(NAN), ValueError, "loss_scale_value"),
    (lambda: FixedLossScale("8"), TypeError, "loss_scale_value"),
    (lambda: DynamicLossScale(initial_loss_scale=0), ValueError, "initial_loss_scale"),
    (lambda: DynamicLossScale(initial_loss_scale=-1.0), ValueError, "initial_loss_scale"),
    (lambda: DynamicLossScale(initial_loss_scale=NAN), ValueError, "initial_loss_scale"),
    (lambda: DynamicLossScale(initial_loss_scale=INF), ValueError, "initial_loss_scale"),
    (lambda: DynamicLossScale(initial_loss_scale=1e39), ValueError, "initial_loss_scale"),
    (lambda: DynamicLossScale(initial_loss_scale=1e-50), ValueError, "initial_loss_scale"),
    (lambda: DynamicLossScale(initial_loss_scale=None), TypeError, "initial_loss_scale"),
    (lambda: DynamicLossScale(increment_period=0), ValueError, "increment_period"),
    (lambda: DynamicLossScale(increment_period=-5), ValueError, "increment_period"),
    (lambda: DynamicLossScale(increment_period=2.5), TypeError, "increment_period"),
    (lambda: DynamicLossScale(increment_period=True), TypeError, "increment_period"),
    (lambda: DynamicLossScale(multiplier=1.0), ValueError, "multiplier"),
    (lambda: DynamicLossScale(multiplier=0.5), ValueError, "multiplier"),
    (lambda: DynamicLossScale(multiplier=1 + 1e-10), ValueError, "multiplier"),
    (lambda: DynamicLossScale(multiplier=NAN), ValueError, "multiplier"),
    (lambda: DynamicLossScale(multiplier=INF), ValueError, "multiplier"),
    (lambda: DynamicLossScale(multiplier="2"), TypeError, "multiplier"),
]


@pytest.mark.parametrize(("factory", "exception", "words"), BAD_ARGUMENTS)
def test_bad_arguments(factory: Any, exception: type[Exception], words: str) -> None:
    with pytest.raises(exception, match=words):
        factory()


def test_loss_scale_is_abstract() -> None:
    with pytest.raises(TypeError):
        LossScale(1.0)  # type: ignore[abstract]


# ---------------------------------------------------------------------- state_dict
def _run(loss_scale: LossScale, flags: list[bool]) -> list[tuple[float, int]]:
    out = []
    for found in flags:
        loss_scale.update_from_found_inf(torch.tensor([float(found)]))
        out.append((float(loss_scale()), int(loss_scale.good_steps)))
    return out


def test_state_dict_resumes_the_sequence() -> None:
    """Save mid-period, load into a differently configured scale: the sequence continues exactly."""
    flags = [False, False, True, False, False, False, False, True, False, False, False, False]
    reference = _run(DynamicLossScale(initial_loss_scale=3, increment_period=3, multiplier=3.0), flags)
    first = DynamicLossScale(initial_loss_scale=3, increment_period=3, multiplier=3.0)
    _run(first, flags[:5])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = DynamicLossScale(initial_loss_scale=7, increment_period=100)
    resumed.load_state_dict(saved)
    assert resumed.get_config() == first.get_config()
    assert _run(resumed, flags[5:]) == reference[5:]
    copied = copy.deepcopy(first)
    pickled = pickle.loads(pickle.dumps(first))
    assert _run(copied, flags[5:]) == _run(pickled, flags[5:]) == reference[5:]


def test_state_dict_is_a_copy() -> None:
    loss_scale = DynamicLossScale(initial_loss_scale=4, increment_period=1)
    saved = loss_scale.state_dict()
    loss_scale.update([torch.ones(1)])
    assert float(saved["current_loss_scale"]) == 4.0 and int(saved["good_steps"]) == 0


BAD_STATES = [
    ({"class": "FixedLossScale", "loss_scale_value": 8.0}, ValueError, "FixedLossScale"),
    ({"class": "DynamicLossScale"}, ValueError, "lacks"),
    ({"current_loss_scale": torch.tensor(NAN)}, ValueError, "current_loss_scale"),
    ({"current_loss_scale": torch.tensor(0.0)}, ValueError, "current_loss_scale"),
    ({"current_loss_scale": torch.tensor(8)}, ValueError, "current_loss_scale"),
    # Positive in float64, 0 in float32, the scale's dtype: every later step would be NaN.
    ({"current_loss_scale": torch.tensor(1e-50, dtype=torch.float64)}, ValueError, "in float32"),
    ({"good_steps": torch.tensor(1.0)}, ValueError, "good_steps"),
    ({"good_steps": torch.tensor(-1)}, ValueError, "good_steps"),
    ({"increment_period": 0}, ValueError, "increment_period"),
    ({"multiplier": 1.0}, ValueError, "multiplier"),
]


@pytest.mark.parametrize(("change", "exception", "words"), BAD_STATES)
def test_bad_state_dict_changes_nothing(
    change: dict[str, Any], exception: type[Exception], words: str
) -> None:
    loss_scale = DynamicLossScale(initial_loss_scale=16, increment_period=4)
    loss_scale.update([torch.ones(1)])
    before = loss_scale.state_dict()
    source = DynamicLossScale(initial_loss_scale=2, increment_period=2).state_dict()
    state = change if change.get("class") else {**source, **change}
    with pytest.raises(exception, match=words):
        loss_scale.load_state_dict(state)
    after = loss_scale.state_dict()
    assert after.keys() == before.keys()
    assert all(
        torch.equal(after[k], v) if isinstance(v, Tensor) else after[k] == v for k, v in before.items()
    )


def test_fixed_state_dict_round_trip() -> None:
    fixed = FixedLossScale(4)
    fixed.load_state_dict(FixedLossScale(1024).state_dict())
    assert float(fixed()) == 1024.0 and fixed.get_config() == {"loss_scale_value": 1024.0}
    with pytest.raises(ValueError, match="DynamicLossScale"):
        fixed.load_state_dict(DynamicLossScale().state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_state_moves_to_the_device() -> None:
    loss_scale = DynamicLossScale(initial_loss_scale=10, increment_period=1, multiplier=3.0).to("cuda")
    assert all(v.is_cuda for v in loss_scale.variables())
    flags = [True, True, False, True]
    assert _run(loss_scale, flags) == _run(DynamicLossScale(10, 1, 3.0), flags)


@pytest.mark.tf_live
def test_generator_reproduces_the_fixtures(run_tf_generator) -> None:
    """Rerun real TensorFlow: both committed fixture files are what the generator writes today."""
    tmp_path = run_tf_generator(GENERATOR)
    for name in ("tf_loss_scale.json", "tf_loss_scale_optimizer.json"):
        fresh, committed = (json.loads((folder / name).read_text()) for folder in (tmp_path, FIXTURES))
        # NaN != NaN: compare the JSON text of each case (NaN is written as NaN).
        assert [json.dumps(c) for c in fresh["cases"]] == [json.dumps(c) for c in committed["cases"]], name
