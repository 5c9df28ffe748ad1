"""torchgrad_compat.train's learning-rate decays: TF's float32 bits at every fixture step, both forms."""

from __future__ import annotations

import inspect
import io
import json
import math
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _deadlines import scaled
from _fused_engine import forget_compiled_kernels
from torch._dynamo.utils import counters
from torch.optim import lr_scheduler as sched

import torchgrad_compat.train.learning_rate_decay as lr_decay
from torchgrad_compat import optim, train

FIXTURES = Path(__file__).parents[1] / "fixtures" / "train"
GENERATOR = Path(__file__).parents[2] / "scripts" / "make_tf_decay_fixtures.py"
FIXTURE = json.loads((FIXTURES / "decays.json").read_text())
CASES = FIXTURE["cases"]
CASE_IDS = [case["id"] for case in CASES]
# The same decays in a TF1 graph (a Session, Grappler on), and configurations Grappler rewrites
# another way.
GRAPH_FIXTURE = json.loads((FIXTURES / "decays_graph.json").read_text())
GRAPH_CASES = GRAPH_FIXTURE["cases"]
GRAPH_CASE_IDS = [case["id"] for case in GRAPH_CASES]
DECAY_FUNCTIONS = [
    "exponential_decay",
    "piecewise_constant",
    "polynomial_decay",
    "natural_exp_decay",
    "inverse_time_decay",
    "cosine_decay",
    "cosine_decay_restarts",
    "linear_cosine_decay",
    "noisy_linear_cosine_decay",
]


def _as_float32(bits: list[int]) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _make(case: dict[str, Any], global_step: Any = None, graph: bool = False) -> train.LearningRateDecay:
    kwargs = case["kwargs"]
    if case["function"] == "bert_warmup":
        decayed = train.polynomial_decay(
            kwargs["init_lr"], global_step, kwargs["num_train_steps"], end_learning_rate=0.0, graph=graph
        )
        return train.linear_warmup(kwargs["init_lr"], decayed, kwargs["num_warmup_steps"])
    if case["function"] == "piecewise_constant":
        return train.piecewise_constant(global_step, **kwargs, graph=graph)
    return getattr(train, case["function"])(global_step=global_step, **kwargs, graph=graph)


@pytest.fixture
def recorded_noise(monkeypatch):
    """Replace the standard normal draw by the numbers the fixture recorded in place of TF's."""

    def install(case: dict[str, Any]) -> None:
        if "noise" in case:
            noise = dict(zip(case["steps"], _as_float32(case["noise"]).tolist(), strict=True))
            monkeypatch.setattr(lr_decay, "_standard_normal", lambda seed, step: noise[step])

    return install


def _assert_bitwise(got: list[float], case: dict[str, Any]) -> None:
    """float32 bits equal at every step; a NaN matches a NaN (its sign bit is the C library's)."""
    want = _as_float32(case["bits"])
    got = np.asarray(got, dtype=np.float32)
    differ = (got.view(np.uint32) != want.view(np.uint32)) & ~(np.isnan(got) & np.isnan(want))
    steps = np.asarray(case["steps"])
    assert not differ.any(), (
        f"{case['id']}: {differ.sum()} of {len(steps)} steps differ, e.g. step "
        f"{steps[differ][0]}: {got[differ][0]!r} vs TF {want[differ][0]!r}"
    )


def test_the_fixtures_cover_every_decay():
    assert set(DECAY_FUNCTIONS) <= {case["function"] for case in CASES}
    assert set(DECAY_FUNCTIONS) <= set(train.__all__)
    # Both ways of staircase and cycle, and steps past float32's exact integers.
    kwargs = [case["kwargs"] for case in CASES]
    assert any(k.get("staircase") for k in kwargs) and any(k.get("cycle") for k in kwargs)
    assert all(max(case["steps"]) >= 10**8 for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_at_gives_tensorflows_bits_at_every_step(case, recorded_noise):
    recorded_noise(case)
    decay = _make(case)
    _assert_bitwise([decay.at(step) for step in case["steps"]], case)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_callable_reads_the_global_step_tensor(case, recorded_noise):
    recorded_noise(case)
    global_step = torch.zeros((), dtype=torch.int64)
    decay = _make(case, global_step)
    values = []
    for step in case["steps"]:
        global_step.fill_(step)
        value = decay()
        assert value.dtype == torch.float32 and value.dim() == 0
        values.append(value.item())
    _assert_bitwise(values, case)


def test_the_graph_fixtures_hold_every_eager_case():
    assert GRAPH_FIXTURE["tf_version"] == FIXTURE["tf_version"]
    graph = {case["id"]: case for case in GRAPH_CASES}
    for case in CASES:
        assert {k: v for k, v in graph[case["id"]].items() if k != "bits"} == {
            k: v for k, v in case.items() if k != "bits"
        }


@pytest.mark.parametrize("case", GRAPH_CASES, ids=GRAPH_CASE_IDS)
def test_graph_gives_a_tf1_graphs_bits_at_every_step(case, recorded_noise):
    recorded_noise(case)
    decay = _make(case, graph=True)
    assert decay.graph
    _assert_bitwise([decay.at(step) for step in case["steps"]], case)


@pytest.mark.parametrize("case", GRAPH_CASES, ids=GRAPH_CASE_IDS)
def test_graph_callable_reads_the_global_step_tensor(case, recorded_noise):
    recorded_noise(case)
    global_step = torch.zeros((), dtype=torch.int64)
    decay = _make(case, global_step, graph=True)
    values = []
    for step in case["steps"]:
        global_step.fill_(step)
        values.append(decay().item())
    _assert_bitwise(values, case)


@pytest.mark.parametrize("name", ["exp_41_stair", "bert_warmup_7", "sgdr_37_tmul1.5_alpha"])
def test_decay_lr_carries_the_graph_numbers(name):
    case = GRAPH_CASES[GRAPH_CASE_IDS.index(name)]
    opt = optim.GradientDescentOptimizer([torch.zeros(1, requires_grad=True)], learning_rate=0.1)
    scheduler = train.DecayLR(opt, _make(case, graph=True))
    steps = [s for s in case["steps"] if s <= 200]
    lrs = []
    for _ in range(steps[-1] + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    want = dict(zip(case["steps"], case["bits"], strict=True))
    _assert_bitwise([lrs[s] for s in steps], {**case, "steps": steps, "bits": [want[s] for s in steps]})


def test_a_python_int_global_step_is_fixed_as_in_tensorflow():
    decay = train.exponential_decay(0.1, 2500, 1000, 0.96)
    assert decay().item() == decay.at(2500) == train.exponential_decay(0.1, None, 1000, 0.96).at(2500)


@pytest.mark.parametrize("name", DECAY_FUNCTIONS)
def test_signatures_are_tensorflows(name):
    # TF 2.21's tf.compat.v1.train signatures (tensorflow/python/keras/optimizer_v2/
    # legacy_learning_rate_decay.py); test_signatures_match_live_tensorflow reads them from TF.
    ours = inspect.signature(getattr(train, name))
    params = [p for p in ours.parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in params] == TF_SIGNATURES[name]


TF_SIGNATURES: dict[str, list[tuple[str, Any]]] = {
    "exponential_decay": [
        ("learning_rate", inspect.Parameter.empty),
        ("global_step", inspect.Parameter.empty),
        ("decay_steps", inspect.Parameter.empty),
        ("decay_rate", inspect.Parameter.empty),
        ("staircase", False),
        ("name", None),
    ],
    "piecewise_constant": [
        ("x", inspect.Parameter.empty),
        ("boundaries", inspect.Parameter.empty),
        ("values", inspect.Parameter.empty),
        ("name", None),
    ],
    "polynomial_decay": [
        ("learning_rate", inspect.Parameter.empty),
        ("global_step", inspect.Parameter.empty),
        ("decay_steps", inspect.Parameter.empty),
        ("end_learning_rate", 0.0001),
        ("power", 1.0),
        ("cycle", False),
        ("name", None),
    ],
    "natural_exp_decay": [
        ("learning_rate", inspect.Parameter.empty),
        ("global_step", inspect.Parameter.empty),
        ("decay_steps", inspect.Parameter.empty),
        ("decay_rate", inspect.Parameter.empty),
        ("staircase", False),
        ("name", None),
    ],
    "inverse_time_decay": [
        ("learning_rate", inspect.Parameter.empty),
        ("global_step", inspect.Parameter.empty),
        ("decay_steps", inspect.Parameter.empty),
        ("decay_rate", inspect.Parameter.empty),
        ("staircase", False),
        ("name", None),
    ],
    "cosine_decay": [
        ("learning_rate", inspect.Parameter.empty),
        ("global_step", inspect.Parameter.empty),
        ("decay_steps", inspect.Parameter.empty),
        ("alpha", 0.0),
        ("name", None),
    ],
    "cosine_decay_restarts": [
        ("learning_rate", inspect.Parameter.empty),
        ("global_step", inspect.Parameter.empty),
        ("first_decay_steps", inspect.Parameter.empty),
        ("t_mul", 2.0),
        ("m_mul", 1.0),
        ("alpha", 0.0),
        ("name", None),
    ],
    "linear_cosine_decay": [
        ("learning_rate", inspect.Parameter.empty),
        ("global_step", inspect.Parameter.empty),
        ("decay_steps", inspect.Parameter.empty),
        ("num_periods", 0.5),
        ("alpha", 0.0),
        ("beta", 0.001),
        ("name", None),
    ],
    "noisy_linear_cosine_decay": [
        ("learning_rate", inspect.Parameter.empty),
        ("global_step", inspect.Parameter.empty),
        ("decay_steps", inspect.Parameter.empty),
        ("initial_variance", 1.0),
        ("variance_decay", 0.55),
        ("num_periods", 0.5),
        ("alpha", 0.0),
        ("beta", 0.001),
        ("name", None),
    ],
}


# The two usage forms, in a training loop: GradientDescent on a loss whose gradient is 1, so each
# step subtracts exactly the learning rate it used (one float32 subtraction).
DECAYS_IN_A_LOOP = {
    "exponential": lambda gs: train.exponential_decay(0.1, gs, 3, 0.5, staircase=True),
    "cosine_restarts": lambda gs: train.cosine_decay_restarts(0.1, gs, 4, t_mul=1.5, m_mul=0.9),
    "warmup_poly": lambda gs: train.linear_warmup(0.1, train.polynomial_decay(0.1, gs, 10, power=2.0), 3),
    # (TF's default variance of 1 makes the learning rate negative half the time: the optimizers refuse it.)
    "noisy_seeded": lambda gs: train.noisy_linear_cosine_decay(0.1, gs, 10, initial_variance=0.01, seed=7),
}
LOOP_STEPS = 12


def _expected_trajectory(decay: train.LearningRateDecay) -> list[torch.Tensor]:
    w = torch.zeros(2)
    out = []
    for step in range(LOOP_STEPS):
        w = w - torch.tensor(decay.at(step), dtype=torch.float32)
        out.append(w)
    return out


@pytest.mark.parametrize("name", list(DECAYS_IN_A_LOOP))
def test_as_learning_rate_the_optimizer_steps_with_the_decay_at_its_global_step(name):
    global_step = torch.zeros((), dtype=torch.int64)
    decay = DECAYS_IN_A_LOOP[name](global_step)
    w = torch.zeros(2, requires_grad=True)
    opt = optim.GradientDescentOptimizer([w], learning_rate=decay)
    for step, expected in enumerate(_expected_trajectory(decay)):
        opt.minimize(lambda: w.sum(), global_step=global_step)
        assert int(global_step) == step + 1
        assert torch.equal(w.detach(), expected), step


@pytest.mark.parametrize("fused", [None, True], ids=["default", "fused"])
@pytest.mark.parametrize("name", list(DECAYS_IN_A_LOOP))
def test_as_scheduler_the_group_lr_follows_the_decay(name, fused):
    decay = DECAYS_IN_A_LOOP[name](None)
    w = torch.zeros(2, requires_grad=True)
    opt = optim.GradientDescentOptimizer([w], learning_rate=0.1, fused=fused)
    scheduler = train.DecayLR(opt, decay)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, expected in enumerate(_expected_trajectory(decay)):
            lr = opt.param_groups[0]["lr"]
            assert type(lr) is float and lr == decay.at(step) and scheduler.get_last_lr() == [lr]
            w.grad = torch.ones(2)
            opt.step()
            scheduler.step()
            assert torch.equal(w.detach(), expected), step
    # torch's scheduler warnings (order of steps, overridden step) would say it is driven unlike torch's own.
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]


def test_a_decay_per_param_group():
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = optim.MomentumOptimizer([{"params": [a]}, {"params": [b]}], learning_rate=0.1, momentum=0.9)
    decays = [train.cosine_decay(0.1, None, 5), train.piecewise_constant(None, [2], [0.3, 0.03])]
    scheduler = train.DecayLR(opt, decays)
    for step in range(6):
        assert [g["lr"] for g in opt.param_groups] == [d.at(step) for d in decays]
        opt.step()
        scheduler.step()


def test_sequential_lr_warms_up_then_restarts_the_decay_at_its_milestone():
    decay = train.exponential_decay(0.1, None, 2, 0.5)
    w = torch.zeros(1, requires_grad=True)
    opt = optim.GradientDescentOptimizer([w], learning_rate=0.1)
    warmup = sched.LinearLR(opt, start_factor=0.25, total_iters=3)
    sequential = sched.SequentialLR(opt, [warmup, train.DecayLR(opt, decay)], milestones=[3])
    reference = optim.GradientDescentOptimizer([torch.zeros(1, requires_grad=True)], learning_rate=0.1)
    reference_warmup = sched.LinearLR(reference, start_factor=0.25, total_iters=3)
    for step in range(10):
        lr = opt.param_groups[0]["lr"]
        if step < 3:
            assert lr == reference.param_groups[0]["lr"], step
        else:
            assert lr == decay.at(step - 3), step
        opt.step()
        reference.step()
        sequential.step()
        reference_warmup.step()


def test_chained_scheduler_scales_the_value_decay_lr_sets():
    decay = train.inverse_time_decay(0.1, None, 3, 0.5)
    w = torch.zeros(1, requires_grad=True)
    opt = optim.GradientDescentOptimizer([w], learning_rate=0.1)
    chained = sched.ChainedScheduler([train.DecayLR(opt, decay), sched.ExponentialLR(opt, gamma=0.9)])
    assert opt.param_groups[0]["lr"] == decay.at(0)
    for step in range(1, 8):
        opt.step()
        chained.step()
        assert opt.param_groups[0]["lr"] == decay.at(step) * 0.9, step


def test_step_with_an_epoch_uses_the_closed_form():
    decay = train.cosine_decay(0.1, None, 100, alpha=0.1)
    opt = optim.GradientDescentOptimizer([torch.zeros(1, requires_grad=True)], learning_rate=0.1)
    scheduler = train.DecayLR(opt, decay)
    opt.step()
    with pytest.warns(UserWarning, match="epoch"):
        scheduler.step(42)
    assert opt.param_groups[0]["lr"] == decay.at(42)


def _run_with_resume(decay: train.LearningRateDecay, stop: int | None) -> tuple[list[float], torch.Tensor]:
    """12 Momentum steps under DecayLR; with ``stop``, saved there (through bytes) and resumed anew."""

    def fresh() -> tuple[torch.Tensor, optim.MomentumOptimizer, train.DecayLR]:
        w = torch.linspace(-1, 1, 5).requires_grad_()
        opt = optim.MomentumOptimizer([w], learning_rate=0.1, momentum=0.9)
        return w, opt, train.DecayLR(opt, decay)

    w, opt, scheduler = fresh()
    lrs = []
    for step in range(12):
        if step == stop:
            buffer = io.BytesIO()
            torch.save({"w": w.detach(), "opt": opt.state_dict(), "sched": scheduler.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
            w, opt, scheduler = fresh()
            with torch.no_grad():
                w.copy_(saved["w"])
            opt.load_state_dict(saved["opt"])
            scheduler.load_state_dict(saved["sched"])
        lrs.append(opt.param_groups[0]["lr"])
        w.grad = w.detach() * 2 - 1
        opt.step()
        scheduler.step()
    return lrs, w.detach()


@pytest.mark.parametrize(
    "decay",
    [
        train.polynomial_decay(0.1, None, 9, power=0.5, cycle=True),
        train.noisy_linear_cosine_decay(0.1, None, 9, initial_variance=0.01, seed=3),
    ],
    ids=["polynomial_cycle", "noisy_seeded"],
)
def test_state_dict_resumes_bitwise(decay):
    straight_lrs, straight_w = _run_with_resume(decay, stop=None)
    resumed_lrs, resumed_w = _run_with_resume(decay, stop=5)
    assert resumed_lrs == straight_lrs
    assert torch.equal(resumed_w, straight_w)


def test_state_dict_holds_the_step_not_the_decays():
    opt = optim.GradientDescentOptimizer([torch.zeros(1, requires_grad=True)], learning_rate=0.1)
    state = train.DecayLR(opt, train.exponential_decay(0.1, None, 3, 0.5)).state_dict()
    assert "decays" not in state and state["last_epoch"] == 0


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"last_epoch": "3"}, "Invalid last_epoch value: '3'"),
        ({"last_epoch": -2}, "Invalid last_epoch value: -2"),
        ({}, "Invalid last_epoch value: None"),
        ({"last_epoch": 4, "decays": []}, r"holds \['decays'\]"),
    ],
)
def test_a_bad_state_dict_changes_nothing(state, match):
    opt = optim.GradientDescentOptimizer([torch.zeros(1, requires_grad=True)], learning_rate=0.1)
    scheduler = train.DecayLR(opt, train.exponential_decay(0.1, None, 3, 0.5))
    before = dict(scheduler.__dict__)
    with pytest.raises(ValueError, match=match):
        scheduler.load_state_dict(state)
    assert scheduler.__dict__ == before


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs_per_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], compile_step: bool) -> list[int]:
    """Dynamo's count of unique graphs after each of 10 steps under DecayLR."""
    scheduler = train.DecayLR(opt, train.exponential_decay(0.1, None, 2, 0.7))
    step = torch.compile(opt.step) if compile_step else opt.step
    gen = torch.Generator().manual_seed(0)
    counts, lrs = [], set()
    for _ in range(10):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        step()
        lrs.add(opt.param_groups[0]["lr"])
        scheduler.step()
        counts.append(counters["stats"]["unique_graphs"])
    assert len(lrs) == 10
    return counts


def test_a_fused_step_does_not_recompile_as_the_decay_changes_lr(fresh_dynamo, monkeypatch):
    # (A kernel another test of this process compiled would be called without dynamo: none is kept.)
    forget_compiled_kernels(monkeypatch)
    params = [torch.randn(4, 3).requires_grad_(), torch.randn(5).requires_grad_()]
    opt = optim.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, fused=True)
    counts = _graphs_per_step(opt, params, compile_step=False)
    # The fused kernel's graph, compiled at the first step; 9 more values of lr add none.
    assert counts == [counts[0]] * 10 and counts[0] >= 1


def test_a_compiled_step_does_not_recompile_as_the_decay_changes_lr(fresh_dynamo):
    params = [torch.randn(4, 3).requires_grad_(), torch.randn(5).requires_grad_()]
    opt = optim.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9)
    counts = _graphs_per_step(opt, params, compile_step=True)
    # torch.optim's bar: the first graph specialises on the float lr, the second serves every later value.
    assert counts[-1] <= 2 and counts[2:] == [counts[2]] * 8


def test_noise_with_a_seed_is_a_function_of_the_step():
    decay = train.noisy_linear_cosine_decay(0.1, None, 1000, seed=11)
    forward = [decay.at(step) for step in range(20)]
    backward = [decay.at(step) for step in reversed(range(20))][::-1]
    assert forward == backward
    assert forward != [train.noisy_linear_cosine_decay(0.1, None, 1000, seed=12).at(s) for s in range(20)]
    quiet = train.noisy_linear_cosine_decay(0.1, None, 1000, initial_variance=0.0)
    assert forward != [quiet.at(step) for step in range(20)]


def test_noise_without_a_seed_follows_torch_manual_seed():
    decay = train.noisy_linear_cosine_decay(0.1, None, 1000)
    torch.manual_seed(5)
    first = [decay.at(3) for _ in range(4)]
    torch.manual_seed(5)
    assert [decay.at(3) for _ in range(4)] == first
    assert len(set(first)) == 4  # a fresh draw at each evaluation, as TF's unseeded op


# Bad input: (function, arguments, exception, message).
BAD_INPUTS = [
    (
        "exponential_decay",
        (0.1, None, 0, 0.96),
        ValueError,
        r"Invalid decay_steps value: 0; expected a value in \(0",
    ),
    ("exponential_decay", (0.1, None, -5, 0.96), ValueError, "Invalid decay_steps value: -5"),
    ("exponential_decay", (0.1, None, math.nan, 0.96), ValueError, "Invalid decay_steps value: nan"),
    (
        "exponential_decay",
        (0.1, None, 1e-50, 0.96),
        ValueError,
        "Invalid decay_steps value: 1e-50.*rounds to 0.0",
    ),
    ("exponential_decay", (0.1, None, "10", 0.96), TypeError, "decay_steps must be a Python number"),
    (
        "exponential_decay",
        (0.1, None, 10**400, 0.96),
        ValueError,
        "Invalid decay_steps value: an int of 1329 bits",
    ),
    ("exponential_decay", (-0.1, None, 10, 0.96), ValueError, "Invalid learning_rate value: -0.1"),
    ("exponential_decay", (math.nan, None, 10, 0.96), ValueError, "Invalid learning_rate value: nan"),
    ("exponential_decay", (math.inf, None, 10, 0.96), ValueError, "Invalid learning_rate value: inf"),
    (
        "exponential_decay",
        (1e39, None, 10, 0.96),
        ValueError,
        "Invalid learning_rate value: 1e\\+39.*rounds to inf",
    ),
    (
        "exponential_decay",
        (torch.tensor(0.1, dtype=torch.float64), None, 10, 0.96),
        TypeError,
        "learning_rate given as a tensor must be 0-d float32",
    ),
    (
        "exponential_decay",
        (torch.tensor(-1.0), None, 10, 0.96),
        ValueError,
        "Invalid learning_rate value: -1.0",
    ),
    ("exponential_decay", (0.1, None, 10, -0.5), ValueError, "Invalid decay_rate value: -0.5"),
    ("exponential_decay", (0.1, None, 10, math.nan), ValueError, "Invalid decay_rate value: nan"),
    ("exponential_decay", (0.1, None, 10, 0.96, 1), TypeError, "staircase must be a bool"),
    ("exponential_decay", (0.1, -1, 10, 0.96), ValueError, "Invalid global_step value: -1"),
    ("exponential_decay", (0.1, 1.5, 10, 0.96), TypeError, "global_step must be a 0-d integer tensor"),
    (
        "exponential_decay",
        (0.1, torch.zeros(()), 10, 0.96),
        TypeError,
        "0-d int32 or int64, got 0-d torch.float32",
    ),
    (
        "exponential_decay",
        (0.1, torch.zeros(2, dtype=torch.int64), 10, 0.96),
        TypeError,
        "got 1-d torch.int64",
    ),
    ("natural_exp_decay", (0.1, None, 0.0, 0.5), ValueError, "Invalid decay_steps value: 0.0"),
    ("natural_exp_decay", (0.1, None, 10, -0.5), ValueError, "Invalid decay_rate value: -0.5"),
    ("inverse_time_decay", (0.1, None, -1, 0.5), ValueError, "Invalid decay_steps value: -1"),
    ("inverse_time_decay", (0.1, None, 10, math.inf), ValueError, "Invalid decay_rate value: inf"),
    ("polynomial_decay", (0.1, None, 0), ValueError, "Invalid decay_steps value: 0"),
    ("polynomial_decay", (0.1, None, 10, 0.0001, -1.0), ValueError, "Invalid power value: -1.0"),
    ("polynomial_decay", (0.1, None, 10, 0.0001, math.nan), ValueError, "Invalid power value: nan"),
    ("polynomial_decay", (0.1, None, 10, -0.01), ValueError, "Invalid end_learning_rate value: -0.01"),
    ("polynomial_decay", (0.1, None, 10, 0.0001, 1.0, "no"), TypeError, "cycle must be a bool"),
    ("piecewise_constant", (None, [10, 5], [0.1, 0.2, 0.3]), ValueError, r"strictly increasing.*\[1\] = 5"),
    ("piecewise_constant", (None, [10, 10], [0.1, 0.2, 0.3]), ValueError, "strictly increasing"),
    ("piecewise_constant", (None, [10], [0.1, 0.2, 0.3]), ValueError, "one fewer than values, which has 3"),
    ("piecewise_constant", (None, [10, 20], [0.1, 0.2]), ValueError, "one fewer than values, which has 2"),
    ("piecewise_constant", (None, [], [0.1]), ValueError, "at least one boundary"),
    ("piecewise_constant", (None, [10.0], [0.1, 0.2]), TypeError, r"boundaries\[0\] must be an int"),
    ("piecewise_constant", (None, [10], [0.1, -0.2]), ValueError, r"Invalid values\[1\] value: -0.2"),
    ("piecewise_constant", (None, [10], [math.nan, 0.2]), ValueError, r"Invalid values\[0\] value: nan"),
    ("piecewise_constant", (-3, [10], [0.1, 0.2]), ValueError, "Invalid global_step value: -3"),
    ("cosine_decay", (0.1, None, 0), ValueError, "Invalid decay_steps value: 0"),
    (
        "cosine_decay",
        (0.1, None, 10, 1.5),
        ValueError,
        r"Invalid alpha value: 1.5; expected a value in \[0.0, 1.0\]",
    ),
    ("cosine_decay", (0.1, None, 10, math.nan), ValueError, "Invalid alpha value: nan"),
    ("cosine_decay_restarts", (0.1, None, 0), ValueError, "Invalid first_decay_steps value: 0"),
    ("cosine_decay_restarts", (0.1, None, 10, 0.0), ValueError, "Invalid t_mul value: 0.0"),
    ("cosine_decay_restarts", (0.1, None, 10, 2.0, -1.0), ValueError, "Invalid m_mul value: -1.0"),
    ("cosine_decay_restarts", (0.1, None, 10, 2.0, 1.0, -0.1), ValueError, "Invalid alpha value: -0.1"),
    ("linear_cosine_decay", (0.1, None, 10, -0.5), ValueError, "Invalid num_periods value: -0.5"),
    ("linear_cosine_decay", (0.1, None, 10, 0.5, 0.0, math.nan), ValueError, "Invalid beta value: nan"),
    ("noisy_linear_cosine_decay", (0.1, None, 10, -1.0), ValueError, "Invalid initial_variance value: -1.0"),
    (
        "noisy_linear_cosine_decay",
        (0.1, None, 10, 1.0, math.nan),
        ValueError,
        "Invalid variance_decay value: nan",
    ),
]


@pytest.mark.parametrize(
    ("name", "args", "exc", "match"), BAD_INPUTS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_refused_by_name(name, args, exc, match):
    with pytest.raises(exc, match=match):
        getattr(train, name)(*args)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"seed": -1}, ValueError, "Invalid seed value: -1"),
        ({"seed": 1.0}, TypeError, "seed must be None or an int"),
    ],
)
def test_a_bad_seed_is_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        train.noisy_linear_cosine_decay(0.1, None, 10, **kwargs)


# The first arguments of each decay function, for the graph argument's checks.
GRAPH_ARGS = {
    name: (0.1, None, 10, 0.5) if "exp" in name or "inverse" in name else (0.1, None, 10)
    for name in DECAY_FUNCTIONS
}
GRAPH_ARGS["piecewise_constant"] = (None, [10], [0.1, 0.05])


@pytest.mark.parametrize("name", DECAY_FUNCTIONS)
@pytest.mark.parametrize("graph", [1, None, "yes"])
def test_a_bad_graph_is_refused(name, graph):
    with pytest.raises(TypeError, match=f"graph must be a bool, got {type(graph).__name__}"):
        getattr(train, name)(*GRAPH_ARGS[name], graph=graph)


@pytest.mark.parametrize("name", [n for n in DECAY_FUNCTIONS if n != "piecewise_constant"])
def test_graph_refuses_a_tensor_learning_rate(name):
    # A graph folds a constant learning rate into the decay's other constants; a tensor read at
    # each evaluation is a variable there, which Grappler leaves alone: other numbers.
    lr, *rest = GRAPH_ARGS[name]
    with pytest.raises(TypeError, match="learning_rate must be a Python number with graph=True"):
        getattr(train, name)(torch.tensor(lr), *rest, graph=True)
    assert not getattr(train, name)(torch.tensor(lr), *rest).graph


def test_linear_warmup_computes_as_its_decay_does():
    eager, graph = (train.cosine_decay(0.1, None, 10, graph=g) for g in (False, True))
    # 0.1 * (6 / 7) and 6 * (0.1 * (1 / 7)): one float32 ulp apart.
    assert train.linear_warmup(0.1, eager, 7).at(6) == 0.08571428805589676
    assert train.linear_warmup(0.1, graph, 7).at(6) == 0.08571429550647736
    assert train.linear_warmup(0.1, graph, 7).graph and "graph=True" in repr(
        train.linear_warmup(0.1, graph, 7)
    )
    with pytest.raises(TypeError, match="learning_rate must be a Python number with graph=True"):
        train.linear_warmup(torch.tensor(0.1), graph, 7)


def test_bad_steps_are_refused_at_evaluation():
    global_step = torch.tensor(-1)
    decay = train.exponential_decay(0.1, global_step, 10, 0.5)
    with pytest.raises(ValueError, match="Invalid global_step value: -1"):
        decay()
    with pytest.raises(ValueError, match="Invalid global_step value: -2"):
        decay.at(-2)
    with pytest.raises(TypeError):
        decay.at(1.5)
    with pytest.raises(RuntimeError, match="made with global_step=None"):
        train.exponential_decay(0.1, None, 10, 0.5)()


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((0.1, "decay", 3), TypeError, "decayed must be a LearningRateDecay"),
        ((0.1, None, 0), ValueError, "Invalid num_warmup_steps value: 0"),
        ((0.1, None, 2.0), TypeError, "num_warmup_steps must be an int"),
        ((-0.1, None, 3), ValueError, "Invalid learning_rate value: -0.1"),
    ],
)
def test_bad_warmup_is_refused(args, exc, match):
    lr, decayed, steps = args
    decayed = train.cosine_decay(0.1, None, 10) if decayed is None else decayed
    with pytest.raises(exc, match=match):
        train.linear_warmup(lr, decayed, steps)


@pytest.mark.parametrize(
    ("make_decay", "group_lr", "exc", "match"),
    [
        (lambda: "exponential", 0.1, TypeError, r"decay\[0\] must be a LearningRateDecay"),
        (
            lambda: [train.cosine_decay(0.1, None, 5)] * 2,
            0.1,
            ValueError,
            r"2 decays; expected one per param group \(1\)",
        ),
        (
            lambda: train.cosine_decay(0.1, None, 5),
            lambda: 0.1,
            TypeError,
            r"param_groups\[0\]\['lr'\] is a callable",
        ),
    ],
    ids=["not_a_decay", "count", "callable_lr"],
)
def test_a_bad_scheduler_changes_nothing(make_decay, group_lr, exc, match):
    opt = optim.GradientDescentOptimizer([torch.zeros(1, requires_grad=True)], learning_rate=group_lr)
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(exc, match=match):
        train.DecayLR(opt, make_decay())
    assert [dict(g) for g in opt.param_groups] == before
    assert not hasattr(opt.step, "_wrapped_by_lr_sched")


@pytest.mark.tf_live
def test_generator_reproduces_the_fixtures(run_tf_generator) -> None:
    """Rerun real TensorFlow: the committed fixtures are what the generator writes today."""
    out = run_tf_generator(GENERATOR)
    assert json.loads((out / "decays.json").read_text())["cases"] == CASES
    assert json.loads((out / "decays_graph.json").read_text())["cases"] == GRAPH_CASES


_TF_SIGNATURES = """
import inspect, json
import tensorflow as tf
out = {}
for name in %r:
    params = inspect.signature(getattr(tf.compat.v1.train, name)).parameters.values()
    out[name] = [[p.name, None if p.default is inspect.Parameter.empty else repr(p.default)] for p in params]
print(json.dumps(out))
"""


@pytest.mark.tf_live
def test_signatures_match_live_tensorflow(tf_python: str) -> None:
    result = subprocess.run(
        [tf_python, "-c", _TF_SIGNATURES % DECAY_FUNCTIONS],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    for name, params in TF_SIGNATURES.items():
        ours = [[p, None if d is inspect.Parameter.empty else repr(d)] for p, d in params]
        assert ours == theirs[name], name
