"""LossScaleOptimizer against real TensorFlow, torch.amp.GradScaler and unscaled control runs.

tests/fixtures/amp/tf_loss_scale_optimizer.json was written by
scripts/make_tf_loss_scale_fixtures.py: ``tf.compat.v1.mixed_precision.
MixedPrecisionLossScaleOptimizer`` around GradientDescent, Momentum, Adam (dense
and sparse) and AdagradDA, ten ``minimize(loss, global_step)`` steps of
``loss = Σ var0·t0 + Σ var1·t1`` with inf, -inf, NaN and a finite value that
overflows once scaled injected into ``t`` at steps 2, 5, 7 and 8. Every step
records the variables, the slots, the non-slot state, ``global_step``, the
scale and the good-step counter. Each case runs here three ways: ``minimize``,
``compute_gradients`` + ``apply_gradients`` (TF style) and
``get_scaled_loss(loss).backward(); step()`` (torch style).
"""

from __future__ import annotations

import copy
import io
import json
import math
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _fused_engine import record_unscaling_kernels
from _host_reads import HostReads
from optim_specs import SPECS, OptimSpec
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import torchgrad_compat.amp.loss_scale_optimizer as lso_module
import torchgrad_compat.optim as tgo
from torchgrad_compat.amp import DynamicLossScale, FixedLossScale, LossScaleOptimizer
from torchgrad_compat.optim.wrapper import OptimizerWrapper

FIXTURES = Path(__file__).parents[1] / "fixtures" / "amp"
TRAJECTORIES: list[dict[str, Any]] = json.loads((FIXTURES / "tf_loss_scale_optimizer.json").read_text())[
    "cases"
]
MODES = ("minimize", "compute_apply", "step")
# "step_fused": torch style around the fused optimizer (with a fixed scale its kernels unscale).
TRAJECTORY_MODES = (*MODES, "step_fused")
# DESIGN.md's float32 parity target. The scales are powers of two, so scaling and
# unscaling are exact and the differences are the inner optimizers' own: measured,
# 1.2e-7 absolute for Adam (one float32 ulp of var0, torch's sqrt), 1.5e-8 for
# AdagradDA, and bitwise equality for every other case and every scale and counter.
RTOL, ATOL = 1e-5, 1e-6
NAN, INF = math.nan, math.inf


# ---------------------------------------------------------------------- TensorFlow trajectories
def _loss(case: dict[str, Any], params: list[Tensor], k: int) -> Tensor:
    t0, t1 = (torch.tensor(case["targets"][i][k]) for i in range(2))
    if case["var0_grad"] == "sparse":
        read0 = F.embedding(torch.tensor(case["sparse_rows"]), params[0], sparse=True)
    else:
        read0 = params[0]
    return (read0 * t0).sum() + (params[1] * t1).sum()


def _run_trajectory(case: dict[str, Any], mode: str) -> tuple[list[dict[str, Any]], list[Tensor]]:
    params = [nn.Parameter(torch.tensor(init, dtype=torch.float32)) for init in case["init"]]
    tf_style = mode not in ("step", "step_fused")
    global_step = torch.zeros((), dtype=torch.int64) if tf_style else None
    kwargs = dict(case["kwargs"])
    if case["optimizer"] == "AdagradDAOptimizer" and tf_style:
        kwargs["global_step"] = global_step  # TF's AdagradDA reads T = global_step + 1
    inner = getattr(tgo, case["optimizer"])(params, **kwargs, fused=mode == "step_fused" or None)
    scale_cls = {"DynamicLossScale": DynamicLossScale, "FixedLossScale": FixedLossScale}
    loss_scale = scale_cls[case["loss_scale"]["class"]](**case["loss_scale"]["kwargs"])
    opt = LossScaleOptimizer(inner, loss_scale)
    steps = []
    for k in range(len(case["targets"][0])):
        if mode == "minimize":
            opt.minimize(lambda k=k: _loss(case, params, k), global_step=global_step)
        elif mode == "compute_apply":
            opt.apply_gradients(opt.compute_gradients(_loss(case, params, k)), global_step=global_step)
        else:
            opt.zero_grad()
            opt.get_scaled_loss(_loss(case, params, k)).backward()
            opt.step()
        record: dict[str, Any] = {f"var{i}": p.detach().clone() for i, p in enumerate(params)}
        for i, p in enumerate(params):
            for name in case["slots"]:
                record[f"slot{i}/{name}"] = opt.get_slot(p, name).clone()
        non_slot = inner.state_dict()["param_groups"][0]
        record.update({f"non_slot/{name}": non_slot[name].clone() for name in case["non_slots"]})
        record["scale"] = float(opt.loss_scale())
        if isinstance(loss_scale, DynamicLossScale):
            record["good_steps"] = int(loss_scale.good_steps)
        if global_step is not None:
            record["global_step"] = int(global_step)
        steps.append(record)
    return steps, params


@pytest.mark.parametrize(
    ("case", "mode"),
    [
        pytest.param(case, mode, id=f"{case['id']}-{mode}")
        for case in TRAJECTORIES
        for mode in TRAJECTORY_MODES
    ],
)
def test_trajectory_matches_tensorflow(case: dict[str, Any], mode: str) -> None:
    ours, _ = _run_trajectory(case, mode)
    expected = case["steps"]
    for k, record in enumerate(ours):
        for key, value in record.items():
            theirs = expected[key][k]
            what = f"{key} after step {k + 1}"
            if isinstance(value, Tensor):
                np.testing.assert_allclose(
                    value.numpy(), np.array(theirs, np.float32), RTOL, ATOL, err_msg=what
                )
            else:
                assert value == theirs, what


DYNAMIC_TRAJECTORIES = [c for c in TRAJECTORIES if c["loss_scale"]["class"] == "DynamicLossScale"]


@pytest.mark.parametrize("case", DYNAMIC_TRAJECTORIES, ids=[c["id"] for c in DYNAMIC_TRAJECTORIES])
def test_skipped_steps_are_bitwise_no_ops(case: dict[str, Any]) -> None:
    """Where TF skipped (the scale fell), every variable and slot is bitwise what it was."""
    ours, _ = _run_trajectory(case, "step")
    skipped = [k for k in range(1, len(ours)) if case["steps"]["scale"][k] < case["steps"]["scale"][k - 1]]
    assert skipped == [1, 4, 6, 7]  # steps 2, 5, 7 and 8 (0-based here)
    for k in skipped:
        for key, value in ours[k].items():
            if isinstance(value, Tensor):
                assert torch.equal(value, ours[k - 1][key]), f"{key} moved on skipped step {k + 1}"


def test_fixture_cases() -> None:
    """The fixtures hold what the tests rely on: skips that leave global_step and Adam's powers alone."""
    adam = next(c for c in TRAJECTORIES if c["id"] == "Adam-dynamic")
    assert adam["steps"]["global_step"] == [1, 1, 2, 3, 3, 4, 4, 4, 5, 6]
    assert adam["steps"]["non_slot/beta1_power"][0] == adam["steps"]["non_slot/beta1_power"][1]
    fixed = next(c for c in TRAJECTORIES if c["id"] == "GradientDescent-fixed")
    assert math.isinf(fixed["steps"]["var1"][-1][0])  # TF applies -inf under a fixed scale


# ---------------------------------------------------------------------- a skipped step changes nothing
def _torch_adam(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _torch_sgd(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _ours(spec: OptimSpec) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    return lambda params: spec.make(params)


# torch's fused optimizers, whose kernels LossScaleOptimizer lets skip on device: (id, factory).
FUSED: list[tuple[str, Callable[[list[Tensor]], torch.optim.Optimizer]]] = [
    ("torch.Adam.fused", lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True)),
    ("torch.AdamW.fused", lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, fused=True)),
    ("torch.SGD.fused", lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, fused=True)),
    ("torch.SGD.fused.plain", lambda ps: torch.optim.SGD(ps, lr=0.01, fused=True)),
    ("torch.Adagrad.fused", lambda ps: torch.optim.Adagrad(ps, lr=0.01, fused=True)),
]

# (id, factory, supports sparse gradients)
INNER = (
    [(spec.name.removesuffix("Optimizer"), _ours(spec), True) for spec in SPECS]
    + [("torch.Adam", _torch_adam, False), ("torch.SGD", _torch_sgd, False)]
    + [(name, factory, False) for name, factory in FUSED]
)
SHAPES = [(4, 3), (5,), (6, 2)]


def _state(opt: LossScaleOptimizer, params: list[Tensor]) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in params],
        "inner": copy.deepcopy(opt.inner_optimizer.state_dict()),
    }


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _grads(gen: torch.Generator, sparse: bool) -> list[Tensor]:
    grads = [torch.randn(s, generator=gen) for s in SHAPES[:2]]
    if sparse:
        rows = torch.tensor([[1, 4, 1]])
        grads.append(
            torch.sparse_coo_tensor(rows, torch.randn(3, 2, generator=gen), SHAPES[2], check_invariants=True)
        )
    else:
        grads.append(torch.randn(SHAPES[2], generator=gen))
    return grads


def _inject(grads: list[Tensor], gen: torch.Generator) -> None:
    which = int(torch.randint(len(grads), (), generator=gen))
    value = (INF, -INF, NAN)[int(torch.randint(3, (), generator=gen))]
    target = grads[which]._values() if grads[which].is_sparse else grads[which]
    target.view(-1)[int(torch.randint(target.numel(), (), generator=gen))] = value


def _scaled_backward(opt: LossScaleOptimizer, params: list[Tensor]) -> None:
    """A backward pass through ``get_scaled_loss`` that leaves every ``p.grad`` zero: the test
    then assigns the scaled gradients it needs, as a gradient hook could."""
    opt.get_scaled_loss(sum((p * 0).sum() for p in params)).backward()


def _drive(
    opt: LossScaleOptimizer, params: list[Tensor], grads: list[Tensor], mode: str, step: Tensor
) -> None:
    if mode == "step":
        _scaled_backward(opt, params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    else:
        opt.apply_gradients(list(zip(grads, params)), global_step=step)


@pytest.mark.parametrize("mode", ["step", "apply_gradients"])
@pytest.mark.parametrize(("name", "factory", "sparse"), INNER, ids=[i[0] for i in INNER])
def test_skipped_step_changes_nothing(name: str, factory: Any, sparse: bool, mode: str) -> None:
    """Inject inf/-inf/NaN into one element of one gradient, ten times: parameters, slots,
    optimizer-wide state and global_step are bitwise unchanged, and the scale halves each time."""
    gen = torch.Generator().manual_seed(sum(map(ord, name + mode)))
    params = [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]
    opt = LossScaleOptimizer(
        factory(params), DynamicLossScale(initial_loss_scale=2.0**12, increment_period=100)
    )
    global_step = torch.zeros((), dtype=torch.int64)
    for _ in range(2):
        _drive(opt, params, _grads(gen, sparse), mode, global_step)
    for trial in range(10):
        before = _state(opt, params)
        grads = _grads(gen, sparse)
        _inject(grads, gen)
        _drive(opt, params, grads, mode, global_step)
        _assert_same(_state(opt, params), before, f"trial {trial}")
        assert float(opt.loss_scale()) == 2.0 ** (11 - trial)
        assert int(global_step) == (0 if mode == "step" else 2)
    _drive(opt, params, _grads(gen, sparse), mode, global_step)
    assert not torch.equal(params[0], before["params"][0]), "a finite step after the skips applies"


def test_skip_is_global() -> None:
    """An inf in the bias alone leaves the weight unchanged too (the GradScaler probe)."""
    model = nn.Linear(3, 2)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), DynamicLossScale(8.0, 2))
    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    opt.get_scaled_loss(model(torch.ones(1, 3)).sum()).backward()
    model.bias.grad[0] = INF
    opt.step()
    assert torch.equal(model.weight, weight) and torch.equal(model.bias, bias)
    assert float(opt.loss_scale()) == 4.0


# ---------------------------------------------------------------------- control runs and GradScaler
def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(i: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)


def _mse(model: nn.Module, i: int) -> Tensor:
    dtype = next(model.parameters()).dtype
    x, y = (t.to(dtype) for t in _batch(i))
    return F.mse_loss(model(x), y)


@pytest.mark.parametrize("inner", ["ours", "torch"])
def test_matches_an_unscaled_control_that_skips(inner: str) -> None:
    """GradScaler's _run_scaling_case: scaled run with an injected inf ≡ an unscaled run skipping it."""
    make = (
        (lambda ps: tgo.AdamOptimizer(ps, 0.01))
        if inner == "ours"
        else (lambda ps: torch.optim.Adam(ps, 0.01))
    )
    opt = _against_an_unscaled_control(make, {3: INF})
    assert float(opt.loss_scale()) == 128.0 * 2**7 * 0.5**1


def _against_an_unscaled_control(
    make: Callable[[list[Tensor]], torch.optim.Optimizer], poison: dict[int, float]
) -> LossScaleOptimizer:
    """Eight steps scaled (scale 128, growing every step) with the loss times ``poison[i]`` at
    step i, and unscaled without those steps: bitwise the same parameters and state."""
    scaled_model, control_model = _model(), _model()
    opt = LossScaleOptimizer(
        make(list(scaled_model.parameters())), DynamicLossScale(128.0, increment_period=1)
    )
    control = make(list(control_model.parameters()))
    for i in range(8):
        opt.zero_grad()
        opt.get_scaled_loss(_mse(scaled_model, i) * poison.get(i, 1.0)).backward()
        opt.step()
        if i not in poison:
            control.zero_grad()
            _mse(control_model, i).backward()
            control.step()
    for p, q in zip(scaled_model.parameters(), control_model.parameters()):
        assert torch.equal(p, q)
    _assert_same(opt.inner_optimizer.state_dict()["state"], control.state_dict()["state"])
    return opt


@pytest.mark.parametrize(("name", "factory"), FUSED, ids=[f[0] for f in FUSED])
def test_fused_inner_matches_an_unscaled_control_that_skips(name: str, factory: Any) -> None:
    """Around torch's fused optimizers, whose kernels skip on device: NaN at step 0 (before
    any state exists; SGD's would be an uninitialised momentum buffer) and inf at step 3
    ≡ an unscaled run without those steps, parameters and state bitwise."""
    opt = _against_an_unscaled_control(factory, {0: NAN, 3: INF})
    assert float(opt.loss_scale()) == 128.0 * 0.5 * 2**2 * 0.5 * 2**4


# Not torch's foreach Adam: it reads its step counters, CPU tensors, on the host itself.
HOST_READ_INNER = [("Adam", lambda ps: tgo.AdamOptimizer(ps, 0.01)), *FUSED]
# Fused optimizers whose state exists before their first step (or that have none).
READY_FROM_THE_START = {"torch.SGD.fused.plain", "torch.Adagrad.fused"}


@pytest.mark.parametrize(("name", "factory"), HOST_READ_INNER, ids=[f[0] for f in HOST_READ_INNER])
def test_host_reads_per_step(name: str, factory: Any) -> None:
    """step() reads one value on the host, the apply-or-skip decision; around torch's fused
    optimizers none once their state exists (Adam's first step still decides on the host),
    also after unscale_() and on skipped steps."""
    model = _model()
    opt = LossScaleOptimizer(factory(list(model.parameters())), DynamicLossScale(128.0, 2))
    counts = []
    for i in range(4):
        opt.zero_grad()
        opt.get_scaled_loss(_mse(model, i) * (INF if i == 2 else 1.0)).backward()
        if i == 3:
            opt.unscale_()
        with HostReads() as reads:
            opt.step()
        counts.append(reads.count)
    if name not in dict(FUSED):
        assert counts == [1, 1, 1, 1]
    else:
        assert counts == [0 if name in READY_FROM_THE_START else 1, 0, 0, 0]
    assert float(opt.loss_scale()) == 128.0  # grew after step 1, backed off at step 2


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_matches_grad_scaler(fused: bool) -> None:
    """Where the rules coincide (growth 2, backoff 0.5, no floor reached), torch Adam under
    GradScaler and under LossScaleOptimizer take bitwise the same steps with the same scales.

    Fused, GradScaler hands the scale to Adam's kernel, which divides by it; here
    the gradients are multiplied by its reciprocal first: the same, for powers of two.
    """
    model_a, model_b = _model(), _model()
    opt = LossScaleOptimizer(
        torch.optim.Adam(model_a.parameters(), 0.01, fused=fused), DynamicLossScale(1024.0, 2)
    )
    adam = torch.optim.Adam(model_b.parameters(), 0.01, fused=fused)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2
    )
    for i in range(10):
        poison = NAN if i in (2, 6) else 1.0
        opt.zero_grad()
        opt.get_scaled_loss(_mse(model_a, i) * poison).backward()
        opt.step()
        adam.zero_grad()
        scaler.scale(_mse(model_b, i) * poison).backward()
        scaler.step(adam)
        scaler.update()
        assert float(opt.loss_scale()) == scaler.get_scale()
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


STYLE_INNER: dict[str, Callable[[list[Tensor]], torch.optim.Optimizer]] = {
    "Adam": lambda params: tgo.AdamOptimizer(params, 0.01),
    "Momentum": lambda params: tgo.MomentumOptimizer(params, 0.05, 0.9),
    "torch.Adam": lambda params: torch.optim.Adam(params, 0.01),
    "torch.Adam.fused": lambda params: torch.optim.Adam(params, 0.01, fused=True),
}


def _drive_style(mode: str, inner: str, dtype: torch.dtype) -> tuple[list[Tensor], list[float]]:
    model = _model().to(dtype)
    params = list(model.parameters())
    opt = LossScaleOptimizer(
        STYLE_INNER[inner](params), DynamicLossScale(1000.0, increment_period=1, multiplier=3.0)
    )
    scales = []
    for i in range(6):

        def loss(i: int = i) -> Tensor:
            return _mse(model, i) * (INF if i == 2 else 1.0)

        if mode == "minimize":
            opt.minimize(loss)
        elif mode == "compute_apply":
            opt.apply_gradients(opt.compute_gradients(loss()))
        else:
            opt.zero_grad()
            opt.get_scaled_loss(loss()).backward()
            opt.step()
        scales.append(float(opt.loss_scale()))
    return [p.detach().clone() for p in params], scales


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inner", list(STYLE_INNER))
def test_driving_styles_agree_bitwise(inner: str, dtype: torch.dtype) -> None:
    """minimize ≡ compute_gradients + apply_gradients ≡ get_scaled_loss().backward() + step(),
    with a scale that is not a power of two (multiplier 3) and skips along the way."""
    (params, scales), *others = [_drive_style(mode, inner, dtype) for mode in MODES]
    assert 2 in [i for i in range(1, 6) if scales[i] < scales[i - 1]], "step 3 was skipped"
    for other_params, other_scales in others:
        _assert_same(other_params, params)
        assert other_scales == scales


# ---------------------------------------------------------------------- the scaling API
def test_get_unscaled_gradients() -> None:
    """Keras's test: [3, None, -4 (float16)] at scale 2 → [1.5, None, -2], dtypes kept.

    A sparse gradient stays sparse, uncoalesced as it came."""
    opt = LossScaleOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 2)
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[2, 0, 2]]), torch.tensor([4.0, 6.0, 8.0]), (3,), check_invariants=True
    )
    out = opt.get_unscaled_gradients(
        [torch.tensor(3.0), None, torch.tensor(-4.0, dtype=torch.float16), sparse]
    )
    assert out[0].item() == 1.5 and out[1] is None
    assert out[2].dtype == torch.float16 and out[2].item() == -2.0
    assert out[3].is_sparse and not out[3].is_coalesced()
    assert torch.equal(out[3]._indices(), sparse._indices())
    assert torch.equal(out[3]._values(), torch.tensor([2.0, 3.0, 4.0]))
    with pytest.raises(TypeError, match="tensors or None"):
        opt.get_unscaled_gradients([3.0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unscaled_gradients_match_the_fused_kernel(dtype: torch.dtype) -> None:
    """The out-of-place unscale (TF style) equals torch's in-place kernel (torch style) bitwise."""
    opt = LossScaleOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 3.0)
    g = (torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    (ours,) = opt.get_unscaled_gradients([g])
    kernel = g.clone()
    torch._amp_foreach_non_finite_check_and_unscale_([kernel], torch.zeros(1), torch.tensor(1.0 / 3.0))
    assert torch.equal(ours, kernel)


def test_get_scaled_loss() -> None:
    w = torch.ones(2, requires_grad=True)
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), DynamicLossScale(4.0, increment_period=1))
    assert opt.get_scaled_loss(torch.tensor(1.5)).item() == 6.0
    half = opt.get_scaled_loss(torch.tensor(1.5, dtype=torch.float16))
    assert half.dtype == torch.float16 and half.item() == 6.0
    scaled = opt.get_scaled_loss(lambda: w.sum())
    opt.loss_scale.update([torch.ones(1)])  # the callable reads the scale when it is called: 8
    assert callable(scaled) and scaled().item() == 16.0
    with pytest.raises(TypeError, match="loss must be a tensor"):
        opt.get_scaled_loss("1.0")
    with pytest.raises(TypeError, match="loss must be a tensor"):
        opt.compute_gradients(lambda: 1.0)


def test_unscale_then_clip() -> None:
    """unscale_() before clipping clips the true gradients; a non-finite step is skipped, not clipped."""
    scaled_model, control_model = _model(), _model()
    opt = LossScaleOptimizer(tgo.AdamOptimizer(scaled_model.parameters(), 0.01), DynamicLossScale(64.0, 5))
    control = tgo.AdamOptimizer(control_model.parameters(), 0.01)
    for i in range(3):
        opt.zero_grad()
        opt.get_scaled_loss(_mse(scaled_model, i)).backward()
        opt.unscale_()
        nn.utils.clip_grad_norm_(scaled_model.parameters(), 0.05)
        opt.step()
        control.zero_grad()
        _mse(control_model, i).backward()
        nn.utils.clip_grad_norm_(control_model.parameters(), 0.05)
        control.step()
    for p, q in zip(scaled_model.parameters(), control_model.parameters()):
        assert torch.equal(p, q)
    before = [p.detach().clone() for p in scaled_model.parameters()]
    opt.zero_grad()
    opt.get_scaled_loss(_mse(scaled_model, 3) * INF).backward()
    opt.unscale_()
    nn.utils.clip_grad_norm_(scaled_model.parameters(), 0.05)
    opt.step()
    _assert_same([p.detach() for p in scaled_model.parameters()], before)
    assert float(opt.loss_scale()) == 32.0


@pytest.mark.parametrize("cleared_by", [None, "model.zero_grad()"])
def test_a_scaled_backward_after_unscale_is_refused_by_step(cleared_by: str | None) -> None:
    """unscale_(), then another scaled backward pass (accumulating, or after a skipped step whose
    gradients model.zero_grad() cleared): step() would apply those scaled gradients undivided
    (GradientDescent lr 1 at scale 1024 moved w to -1025 instead of -2). It refuses, nothing
    changes, and after opt.zero_grad() the next step is the usual one."""
    w = nn.Parameter(torch.zeros(()))
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w], 1.0), DynamicLossScale(1024.0, 10))
    opt.get_scaled_loss(w + 1).backward()
    opt.unscale_()
    if cleared_by:
        w.grad = None
    opt.get_scaled_loss(w + 1).backward()
    with pytest.raises(RuntimeError, match="came after unscale_"):
        opt.step()
    assert float(w) == 0.0 and float(opt.loss_scale()) == 1024.0
    opt.zero_grad()
    opt.get_scaled_loss(w + 1).backward()
    opt.step()
    assert float(w) == -1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_gradient_that_overflows_once_unscaled_skips_the_step(dtype: torch.dtype) -> None:
    """With a scale below 1, dividing by it multiplies: a finite scaled gradient can overflow.
    TF judges the unscaled gradients, so the step is skipped and the scale backs off to its floor
    of 1, in both driving styles (torch's check-and-unscale kernel looks before it multiplies)."""
    # d loss / dp: 1e40 (float32 max 3.4e38), or 120000 (float16 max 65504); finite when scaled.
    scale, (a, b) = (1e-10, (1e20, 1e20)) if dtype == torch.float32 else (0.5, (60000.0, 2.0))
    results = []
    for style in ("step", "minimize"):
        p = nn.Parameter(torch.ones((), dtype=dtype))
        opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([p], 0.5), DynamicLossScale(scale, 10))
        loss = lambda p=p: (p * a) * b  # noqa: E731
        if style == "step":
            opt.get_scaled_loss(loss()).backward()
            opt.step()
        else:
            opt.minimize(loss, var_list=[p])
        results.append((float(p), float(opt.loss_scale())))
    assert results == [(1.0, 1.0), (1.0, 1.0)]


def _steps_of_zero_gradients(opt: LossScaleOptimizer, params: list[Tensor], steps: int) -> None:
    """``steps`` steps whose gradients, each a tensor of its own, change nothing (what the
    checks find is kept between steps)."""
    for _ in range(steps):
        opt.zero_grad()
        opt.get_scaled_loss(sum(p.sum() * 0.0 for p in params)).backward()
        opt.step()


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize("scale", ["dynamic", "fixed"])
def test_one_gradient_tensor_of_two_parameters_is_unscaled_once(
    scale: str, steps_before: int, fused: bool
) -> None:
    """p.grad and r.grad the same tensor: unscaling it once per parameter divided it by the
    scale squared (GradScaler does too). Also after steps with a gradient for each."""
    p, r = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    loss_scale = DynamicLossScale(8.0, 10) if scale == "dynamic" else 8.0
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([p, r], 1.0, fused=fused), loss_scale)
    _steps_of_zero_gradients(opt, [p, r], steps_before)
    opt.zero_grad()
    opt.get_scaled_loss(p.sum()).backward()
    r.grad = p.grad
    opt.step()
    assert torch.equal(p.detach(), torch.full((2,), -1.0)) and torch.equal(r.detach(), torch.full((2,), -1.0))


def test_sparse_gradients_sharing_one_buffer_are_unscaled_once() -> None:
    """Token and position embeddings summed into one input: each sparse gradient's values are a
    view of the sum's gradient, one buffer. Unscaled once, as the unscaled run's gradients."""
    x, positions = torch.tensor([[1, 5, 1, 2]]), torch.arange(4)[None]
    weights = torch.linspace(-1, 1, 12).reshape(1, 4, 3)
    runs = []
    for scaled in (True, False):
        tok = nn.Parameter(torch.linspace(-1, 1, 18).reshape(6, 3))
        pos = nn.Parameter(torch.linspace(1, 2, 12).reshape(4, 3))
        inner = tgo.AdamOptimizer([tok, pos], learning_rate=0.1)
        opt = LossScaleOptimizer(inner) if scaled else inner
        loss = ((F.embedding(x, tok, sparse=True) + F.embedding(positions, pos, sparse=True)) * weights).sum()
        (opt.get_scaled_loss(loss) if scaled else loss).backward()
        if scaled:
            assert tok.grad._values().data_ptr() == pos.grad._values().data_ptr()
        opt.step()
        runs.append([tok.detach().clone(), pos.detach().clone(), pos.grad.to_dense()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    # Views of one buffer at different offsets would be divided twice where they overlap: refused.
    w, v = nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(4, 3))
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w, v], 0.1))
    loss = F.embedding(x % 4, w, sparse=True).sum() + F.embedding(x % 4, v, sparse=True).sum()
    opt.get_scaled_loss(loss).backward()
    buffer = torch.ones(3, 3)
    rows = torch.tensor([[0, 1]])
    w.grad = torch.sparse_coo_tensor(rows, buffer[:2], (4, 3))
    v.grad = torch.sparse_coo_tensor(rows, buffer[1:], (4, 3))
    shared = "p.grad of parameter 0 and p.grad of parameter 1 share memory"
    with pytest.raises(ValueError, match=shared):
        opt.step()
    assert torch.equal(buffer, torch.ones(3, 3)) and not w.detach().any()
    assert float(opt.loss_scale()) == 2.0**15


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
def test_dense_gradients_that_are_views_of_one_buffer_are_unscaled_once(fused: bool) -> None:
    """Views of one buffer side by side (as DDP's gradient buckets are) are unscaled as any others;
    views that overlap, which unscaling in place would divide twice where they do, are refused
    before anything changes."""
    w, v = nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(4, 3))
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w, v], 1.0, fused=fused), 4.0)
    # (Two steps side by side first: what the checks find is kept between steps.)
    for step, (offset, overlap) in enumerate(((12, False), (12, False), (3, True))):
        opt.get_scaled_loss(w.sum() + v.sum()).backward()
        buffer = torch.full((12 + offset,), 4.0)
        w.grad, v.grad = buffer[:12].view(4, 3), buffer[offset:].view(4, 3)
        if overlap:
            with pytest.raises(ValueError, match="parameter 0 and p.grad of parameter 1 share memory"):
                opt.step()
            assert torch.equal(buffer, torch.full((15,), 4.0))
        else:
            opt.step()
            assert torch.equal(buffer, torch.ones(24))
        applied = min(step + 1, 2)
        assert torch.equal(w.detach(), torch.full((4, 3), -applied)) and torch.equal(v.detach(), w.detach())
        opt.zero_grad()


@pytest.mark.parametrize(
    ("dense", "steps_before", "fused"),
    [(True, 0, False), (False, 0, False), (True, 3, False), (True, 3, True)],
    ids=["dense", "sparse", "dense-after-steps-loop", "dense-after-steps-fused"],
)
def test_a_gradient_in_a_parameters_memory_is_refused(dense: bool, steps_before: int, fused: bool) -> None:
    """Unscaling in place would divide the parameter itself, on a skipped step too. Also after
    steps with a gradient of its own for each parameter."""
    w, v = nn.Parameter(torch.ones(4, 3)), nn.Parameter(torch.ones(4, 3))
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w, v], 0.1, fused=fused))
    _steps_of_zero_gradients(opt, [w, v], steps_before)
    opt.zero_grad()
    opt.get_scaled_loss(w.sum() + v.sum()).backward()
    if dense:
        w.grad = v.detach()
    else:
        w.grad = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), v.detach()[:2], (4, 3))
    v.grad[0, 0] = math.inf
    with pytest.raises(ValueError, match="p.grad of parameter 0 and parameter 1 share memory"):
        opt.step()
    assert torch.equal(v.detach(), torch.ones(4, 3)) and torch.equal(w.detach(), torch.ones(4, 3))
    assert float(opt.loss_scale()) == 2.0**15


def test_complex_gradients_are_unscaled_through_their_real_view() -> None:
    """torch optimizers take complex parameters; torch's unscale kernel takes real dtypes only,
    and it used to raise after the real gradients had been divided (again at each retry)."""
    a, z = nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([1 + 1j, 2 - 1j]))
    ca, cz = nn.Parameter(a.detach().clone()), nn.Parameter(z.detach().clone())
    opt = LossScaleOptimizer(torch.optim.SGD([a, z], lr=0.1), DynamicLossScale(8.0, 100))
    control = torch.optim.SGD([ca, cz], lr=0.1)
    opt.get_scaled_loss((a**2).sum() + (z * z.conj()).real.sum()).backward()
    opt.step()
    ((ca**2).sum() + (cz * cz.conj()).real.sum()).backward()
    control.step()
    assert torch.equal(a, ca) and torch.equal(z, cz)


@pytest.mark.parametrize(
    ("scale", "values", "applied"),
    [
        # Unscaled rows 16000 + 16000 = 32000 fit float16: applied (GradScaler, which sums
        # the scaled rows, would skip).
        (4.0, [64000.0, 64000.0], True),
        # Unscaled rows 40000 + 40000 overflow float16 once summed: skipped.
        (1.0, [40000.0, 40000.0], False),
    ],
)
def test_float16_sparse_sum_overflow(scale: float, values: list[float], applied: bool) -> None:
    p = torch.zeros(3, 2, dtype=torch.float16, requires_grad=True)
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([p], 1e-4), DynamicLossScale(scale, 10))
    rows = torch.tensor(values, dtype=torch.float16)[:, None].expand(2, 2).contiguous()
    _scaled_backward(opt, [p])
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), rows, (3, 2), check_invariants=True)
    opt.step()
    assert bool(p.detach().ne(0).any()) is applied
    assert float(opt.loss_scale()) == (scale if applied else scale / 2 if scale > 1 else 1.0)


def test_step_with_closure() -> None:
    model = _model()
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer(model.parameters(), 0.1), DynamicLossScale(8.0, 1))

    def closure() -> Tensor:
        opt.zero_grad()
        loss = _mse(model, 0)
        opt.get_scaled_loss(loss).backward()
        return loss

    first = opt.step(closure)
    assert isinstance(first, Tensor) and opt.step(closure).item() < first.item()
    assert float(opt.loss_scale()) == 32.0


# ---------------------------------------------------------------------- checkpoints
INJECTED = {2: INF, 7: NAN}


def _train(opt: LossScaleOptimizer, model: nn.Module, steps: range) -> list[float]:
    scales = []
    for i in steps:
        opt.zero_grad()
        opt.get_scaled_loss(_mse(model, i) * INJECTED.get(i, 1.0)).backward()
        opt.step()
        scales.append(float(opt.loss_scale()))
    return scales


def _make(model: nn.Module, inner: str, loss_scale: Any) -> LossScaleOptimizer:
    optimizer = (
        tgo.AdamOptimizer(model.parameters(), 0.01)
        if inner == "ours"
        else torch.optim.Adam(model.parameters(), 0.01)
    )
    return LossScaleOptimizer(optimizer, loss_scale)


@pytest.mark.parametrize("inner", ["ours", "torch"])
@pytest.mark.parametrize("k", [1, 7])
def test_resume_continues_bitwise(k: int, inner: str) -> None:
    """Save at step k mid-period, load (weights_only) into a fresh, differently configured
    optimizer: the next steps and scales are bitwise those of an uninterrupted run."""
    reference_model = _model()
    reference = _make(reference_model, inner, DynamicLossScale(16.0, increment_period=3))
    expected_scales = _train(reference, reference_model, range(12))

    model = _model()
    opt = _make(model, inner, DynamicLossScale(16.0, increment_period=3))
    _train(opt, model, range(k))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model = _model(seed=1)
    resumed_model.load_state_dict(saved["model"])
    resumed = _make(resumed_model, inner, "dynamic")
    resumed.load_state_dict(saved["opt"])
    assert _train(resumed, resumed_model, range(k, 12)) == expected_scales[k:]
    _assert_same(list(resumed_model.parameters()), list(reference_model.parameters()))

    copied_model = copy.deepcopy((model, opt))
    pickled_model = pickle.loads(pickle.dumps((model, opt)))
    for m, o in (copied_model, pickled_model):
        assert _train(o, m, range(k, 12)) == expected_scales[k:]
        _assert_same(list(m.parameters()), list(reference_model.parameters()))


@pytest.mark.filterwarnings("ignore:CrossShardOptimizer. no torch.distributed process group")
def test_its_state_dict_is_refused_by_an_optimizer_without_loss_scaling() -> None:
    """Loaded into the bare optimizer (or one wrapped otherwise), the scale and its counter would be
    dropped, and a LossScaleOptimizer made around it afterwards would start from its own scale."""
    from torchgrad_compat.xla import CrossShardOptimizer

    model = _model()
    opt = LossScaleOptimizer(tgo.AdamOptimizer(list(model.parameters()), 0.01), DynamicLossScale(16.0, 2))
    opt.zero_grad()
    opt.get_scaled_loss(_mse(model, 0)).backward()
    opt.step()
    saved = opt.state_dict()
    for bare in (
        tgo.AdamOptimizer(list(_model().parameters()), 0.01),
        CrossShardOptimizer(tgo.AdamOptimizer(list(_model().parameters()), 0.01)),
    ):
        with pytest.raises(
            ValueError, match=r"holds a LossScaleOptimizer's loss scale \(\['loss_scale_class'"
        ):
            bare.load_state_dict(saved)
        assert not bare.state
    dropped = {
        **saved,
        "param_groups": [
            {k: v for k, v in g.items() if not k.startswith("loss_scale_")} for g in saved["param_groups"]
        ],
    }
    bare = tgo.AdamOptimizer(list(_model().parameters()), 0.01)
    bare.load_state_dict(dropped)
    assert len(bare.state) == 4
    with pytest.raises(
        ValueError, match="different number of parameter groups: 2, where this optimizer has 1"
    ):
        bare.load_state_dict({**dropped, "param_groups": dropped["param_groups"] * 2})


def test_load_state_dict_failure_changes_nothing() -> None:
    model = _model()
    opt = _make(model, "ours", DynamicLossScale(16.0, increment_period=3))
    _train(opt, model, range(4))
    before = copy.deepcopy(opt.state_dict())
    other = _make(nn.Linear(4, 2), "ours", DynamicLossScale(2.0, increment_period=1))
    inner_only = {
        "state": before["state"],
        "param_groups": [
            {k: v for k, v in g.items() if not k.startswith("loss_scale_")} for g in before["param_groups"]
        ],
    }
    with pytest.raises(ValueError, match="loss_scale"):
        opt.load_state_dict(inner_only)
    with pytest.raises(ValueError, match="loss_scale"):
        opt.load_state_dict({"optimizer": inner_only})  # the earlier layout, without its loss scale
    with pytest.raises(ValueError):
        opt.load_state_dict(other.state_dict())  # the wrapped optimizer's groups do not fit
    _assert_same(opt.state_dict(), before)
    assert set(before) == {"state", "param_groups"}


# ---------------------------------------------------------------------- forwarding and errors
@pytest.mark.parametrize("inner", ["ours", "torch"])
def test_delegates_to_the_wrapped_optimizer(inner: str) -> None:
    model = _model()
    opt = _make(model, inner, "dynamic")
    wrapped = opt.inner_optimizer
    assert opt.param_groups is wrapped.param_groups and opt.state is wrapped.state
    opt.learning_rate = 0.5
    assert wrapped.param_groups[0]["lr"] == 0.5 and opt.lr == 0.5
    _train(opt, model, range(1))
    weight = model[0].weight
    slot = "m" if inner == "ours" else "exp_avg"
    assert opt.get_slot(weight, slot) is wrapped.state[weight][slot]
    assert slot in opt.get_slot_names()
    scale, good_steps = opt.variables()[-2:]
    assert scale.dtype == torch.float32 and good_steps.dtype == torch.int64
    assert len(opt.variables()) == len(OptimizerWrapper(wrapped).variables()) + 2
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(AttributeError, match="LossScaleOptimizer"):
        _ = opt.beta1
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(opt, model, range(1, 2))
    scheduler.step()
    assert wrapped.param_groups[0]["lr"] == 0.25


def test_refuses_to_wrap_a_loss_scale_optimizer() -> None:
    inner = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    lso = LossScaleOptimizer(inner)
    with pytest.raises(TypeError, match="cannot wrap another LossScaleOptimizer"):
        LossScaleOptimizer(lso)
    with pytest.raises(TypeError, match="cannot wrap another LossScaleOptimizer .found inside"):
        LossScaleOptimizer(OptimizerWrapper(lso))


BAD_CONSTRUCTION = [
    (lambda opt: LossScaleOptimizer("sgd"), TypeError, "torch.optim.Optimizer"),
    (lambda opt: LossScaleOptimizer(opt, None), ValueError, "loss_scale cannot be None"),
    (lambda opt: LossScaleOptimizer(opt, "static"), ValueError, "loss_scale"),
    (lambda opt: LossScaleOptimizer(opt, 0.5), ValueError, "loss_scale"),
    (lambda opt: LossScaleOptimizer(opt, INF), ValueError, "loss_scale"),
    (lambda opt: LossScaleOptimizer(opt, [8]), TypeError, "loss_scale"),
]


@pytest.mark.parametrize(("factory", "exception", "words"), BAD_CONSTRUCTION)
def test_bad_construction(factory: Any, exception: type[Exception], words: str) -> None:
    with pytest.raises(exception, match=words):
        factory(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))


def test_misuse_raises_before_the_scale_changes() -> None:
    w = torch.ones(2, requires_grad=True)
    stranger = torch.ones(2, requires_grad=True)
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w], 0.1), DynamicLossScale(8.0, 1))
    cases = [
        (opt.step, RuntimeError, "no parameter has a gradient"),
        (opt.unscale_, RuntimeError, "no parameter has a gradient"),
        (lambda: opt.apply_gradients([]), ValueError, "No variables provided"),
        (lambda: opt.apply_gradients([(None, w)]), ValueError, "No gradients provided"),
        (lambda: opt.apply_gradients([(torch.ones(2), stranger)]), ValueError, "does not manage"),
        (lambda: opt.apply_gradients([torch.ones(2)]), TypeError, "pairs"),
        (lambda: opt.apply_gradients([([1.0, 2.0], w)]), TypeError, "Gradient must be a Tensor"),
        (
            lambda: opt.apply_gradients([(torch.ones(2), w)], global_step=torch.tensor(0.0)),
            TypeError,
            "global_step",
        ),
    ]
    for call, exception, words in cases:
        with pytest.raises(exception, match=words):
            call()
        assert float(opt.loss_scale()) == 8.0 and int(opt.loss_scale.good_steps) == 0
    assert torch.equal(w, torch.ones(2))


def test_unscale_twice_raises_and_zero_grad_forgets() -> None:
    w = torch.ones(2, requires_grad=True)
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w], 0.5), DynamicLossScale(8.0, 10))
    opt.get_scaled_loss(w.sum()).backward()
    opt.unscale_()
    assert torch.equal(w.grad, torch.ones(2))
    with pytest.raises(RuntimeError, match="already been called"):
        opt.unscale_()
    opt.zero_grad()
    opt.get_scaled_loss(w.sum()).backward()
    opt.step()  # unscales the new gradients: not stale state from the abandoned unscale_()
    assert torch.equal(w.detach(), torch.full((2,), 0.5))


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
def test_fixed_scale_applies_non_finite_gradients(fused: bool) -> None:
    """TF-exact policy: a fixed scale never checks, so NaN is applied (the fixture shows TF doing it),
    also where the fused kernels unscale."""
    w = torch.ones(2, requires_grad=True)
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([w], 0.5, fused=fused), 4)
    opt.get_scaled_loss((w * torch.tensor([1.0, NAN])).sum()).backward()
    opt.step()
    assert w[0].item() == 0.5 and math.isnan(w[1].item()) and float(opt.loss_scale()) == 4.0
    assert opt.variables() == []


def _fixed_scale_on_fused_adam(scale: float = 1000.0) -> tuple[list[nn.Parameter], LossScaleOptimizer]:
    gen = torch.Generator().manual_seed(5)
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in (7, 40, 3)]
    return params, LossScaleOptimizer(tgo.AdamOptimizer(params, learning_rate=0.1, fused=True), scale)


def _scaled_grads(opt: LossScaleOptimizer, params: list[nn.Parameter], step: int) -> list[Tensor]:
    opt.zero_grad()
    gen = torch.Generator().manual_seed(step)
    loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
    opt.get_scaled_loss(loss).backward()
    return [p.grad.clone() for p in params]


def test_gradients_unscaled_inside_the_fused_pass_end_unscaled_with_new_versions() -> None:
    """Where the fused kernels unscale (a fixed scale), p.grad ends divided by the scale, as after
    the separate pass, and autograd's version counter of each gradient has moved (it was written
    in place)."""
    params, opt = _fixed_scale_on_fused_adam()
    for step in range(3):
        scaled = _scaled_grads(opt, params, step)
        versions = [p.grad._version for p in params]
        opt.step()
        inv = torch.reciprocal(torch.tensor(1000.0))
        assert all(torch.equal(p.grad, g * inv) for p, g in zip(params, scaled, strict=True))
        assert all(p.grad._version > v for p, v in zip(params, versions, strict=True))


@pytest.mark.parametrize("scale", [1000.0, "dynamic"])
def test_an_empty_parameter_leaves_the_others_on_the_usual_path(monkeypatch, scale: Any) -> None:
    """An empty parameter's gradient holds no memory (its address is 0, the parameter's too): the
    others are not taken for gradients that share memory. They keep torch's one check-and-unscale
    call (dynamic scale) or the fused kernels' unscale (fixed scale), with the numbers of the
    same run without the empty parameter."""
    careful, rules = [], record_unscaling_kernels(monkeypatch)
    each_memory_once = lso_module._each_memory_once
    monkeypatch.setattr(lso_module, "_each_memory_once", lambda *a: careful.append(1) or each_memory_once(*a))
    runs = []
    for with_empty in (True, False):
        params, _ = _fixed_scale_on_fused_adam()
        empty = [nn.Parameter(torch.zeros(0, 3))] if with_empty else []
        opt = LossScaleOptimizer(tgo.AdamOptimizer([*empty, *params], learning_rate=0.1, fused=True), scale)
        for step in range(3):
            _scaled_grads(opt, [*empty, *params], step)
            opt.step()
        runs.append(params)
    assert not careful
    assert bool(rules) == (scale != "dynamic")
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("fails", ["before the kernels", "after the kernels"])
def test_a_failed_step_whose_kernels_would_unscale_leaves_no_gradient_unscaled_twice(
    monkeypatch, fails: str
) -> None:
    """A wrapped fused step that raises before its kernels ran leaves p.grad scaled: step() again
    does what the failed call would have done. One that raises after (its gradients may be
    unscaled, in part) makes the next step() ask for a new backward pass, rather than unscale
    them again or apply them scaled. The scale stays as it was either way."""
    params, opt = _fixed_scale_on_fused_adam()
    reference, ref_opt = _fixed_scale_on_fused_adam()
    for step in range(2):
        _scaled_grads(ref_opt, reference, step)
        ref_opt.step()
    _scaled_grads(opt, params, 0)
    opt.step()
    scaled = _scaled_grads(opt, params, 1)
    before = [p.detach().clone() for p in params]
    if fails == "before the kernels":
        opt.param_groups[0]["lr"] = math.nan
        with pytest.raises(ValueError, match="learning_rate value: nan"):
            opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, scaled, strict=True))
        opt.param_groups[0]["lr"] = 0.1
        opt.step()
        assert all(torch.equal(p, r) for p, r in zip(params, reference, strict=True))
    else:
        finish = tgo.AdamOptimizer._finish

        def fail(self: Any, *args: Any) -> None:
            raise RuntimeError("failed after the kernels")

        monkeypatch.setattr(tgo.AdamOptimizer, "_finish", fail)
        with pytest.raises(RuntimeError, match="failed after the kernels"):
            opt.step()
        monkeypatch.setattr(tgo.AdamOptimizer, "_finish", finish)
        assert not all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        with pytest.raises(RuntimeError, match="get_scaled_loss"):
            opt.step()
    assert float(opt.loss_scale()) == 1000.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("fused", "syncs"), [(False, 1), (True, 0)], ids=["foreach", "fused"])
def test_host_syncs_per_step_on_cuda(fused: bool, syncs: int) -> None:
    """CUDA's own count of the syncs in the second step: one (the decision) around SGD
    foreach, none around fused SGD with momentum, whose kernel skips on device."""
    w = torch.nn.Parameter(torch.randn(1000, device="cuda"))
    inner = torch.optim.SGD([w], lr=0.1, momentum=0.9, **({"fused": True} if fused else {"foreach": True}))
    opt = LossScaleOptimizer(inner)
    for _ in range(2):
        opt.zero_grad()
        opt.get_scaled_loss((w * w).sum()).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == syncs


def test_expanded_gradient_gets_a_named_error_before_anything_changes():
    p, q = torch.zeros(4, 3, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([q, p], 0.1), loss_scale=4.0)
    _scaled_backward(opt, [q, p])
    q.grad = torch.full((2,), 4.0)
    p.grad = torch.ones(3).expand(4, 3)  # stride 0: one element stands for four
    with pytest.raises(RuntimeError, match=r"parameter 1 .*expanded view.*p.grad = p.grad.contiguous\(\)"):
        opt.step()
    assert torch.equal(q.grad, torch.full((2,), 4.0))  # nothing was unscaled
    p.grad = p.grad.contiguous()
    opt.step()
    assert torch.equal(p.detach(), torch.full((4, 3), -0.025)) and torch.equal(
        q.detach(), torch.full((2,), -0.1)
    )


@pytest.mark.parametrize("layouts", ["dense", "mixed"])
@pytest.mark.parametrize("bad", [None, 1, 2, 3])
def test_step_unscales_gradients_of_every_kind_as_the_functional_path(bad: int | None, layouts: str) -> None:
    """float32 and float16 gradients in one optimizer, all dense or with a transposed
    (non-contiguous) and a sparse one: step() applies what apply_gradients applies to
    get_unscaled_gradients' result, bitwise, and an inf in any of them (``bad``) skips the step."""
    shapes = [(3,), (4,), (2, 3), (5, 2)]
    dtypes = [torch.float32, torch.float16, torch.float32, torch.float32]
    torch.manual_seed(0)
    grads = [torch.randn(s).to(d) * 64 for s, d in zip(shapes, dtypes, strict=True)]
    if layouts == "mixed":
        grads[2] = torch.randn(3, 2).t() * 64  # non-contiguous
        grads[3] = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.randn(2, 2) * 64, (5, 2))
    if bad is not None:
        values = grads[bad]._values() if grads[bad].is_sparse else grads[bad]
        values[(1,) * values.dim()] = INF
    results = []
    for mode in ("step", "apply"):
        params = [torch.ones(s, dtype=d, requires_grad=True) for s, d in zip(shapes, dtypes, strict=True)]
        opt = LossScaleOptimizer(tgo.AdagradOptimizer(params, 0.1), DynamicLossScale(64.0, 10))
        if mode == "step":
            _scaled_backward(opt, params)
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
        else:
            opt.apply_gradients(list(zip(opt.get_unscaled_gradients(grads), params, strict=True)))
        results.append(([p.detach().clone() for p in params], float(opt.loss_scale())))
    (stepped, scale), (applied, applied_scale) = results
    _assert_same(stepped, applied)
    assert scale == applied_scale == (32.0 if bad is not None else 64.0)
    moved = [not torch.equal(p, torch.ones_like(p)) for p in stepped]
    assert moved == [bad is None] * 4


# ---------------------------------------------------------------------- a step is all or nothing
class _FailsOnce(torch.optim.SGD):
    """SGD whose first ``step`` raises before changing anything (a transient failure)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.failures = 1

    def step(self, closure: Any = None) -> Any:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("transient failure")
        return super().step(closure)


def _unscaled_run(slopes: list[list[float]]) -> Tensor:
    """SGD with lr 0.5 on ``Σ w·slope`` per step, no loss scaling: where ``w`` should end."""
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    sgd = torch.optim.SGD([w], lr=0.5)
    for slope in slopes:
        sgd.zero_grad()
        (w * torch.tensor(slope)).sum().backward()
        sgd.step()
    return w.detach()


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_a_failed_step_then_a_retry_is_the_first_attempt(unscale_first: bool) -> None:
    """The wrapped optimizer raises: the scale, its counter and the unscaled gradients are as if
    step() had not run (p.grad stays unscaled, as after unscale_()); the retry applies them once."""
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = LossScaleOptimizer(_FailsOnce([w], lr=0.5), DynamicLossScale(8.0, increment_period=2))
    opt.get_scaled_loss((w * torch.tensor([1.0, 3.0])).sum()).backward()
    if unscale_first:
        opt.unscale_()
    with pytest.raises(RuntimeError, match="transient failure"):
        opt.step()
    assert torch.equal(w.grad, torch.tensor([1.0, 3.0]))  # unscaled once, not yet applied
    assert float(opt.loss_scale()) == 8.0 and int(opt.loss_scale.good_steps) == 0
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))
    opt.step()
    assert torch.equal(w.detach(), _unscaled_run([[1.0, 3.0]]))
    assert float(opt.loss_scale()) == 8.0 and int(opt.loss_scale.good_steps) == 1
    opt.zero_grad()
    opt.get_scaled_loss((w * torch.tensor([2.0, -1.0])).sum()).backward()
    opt.step()  # the second finite step of the period: the scale grows, once
    assert torch.equal(w.detach(), _unscaled_run([[1.0, 3.0], [2.0, -1.0]]))
    assert float(opt.loss_scale()) == 16.0 and int(opt.loss_scale.good_steps) == 0


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "inf"])
def test_a_failed_apply_gradients_leaves_the_scale_for_the_retry(finite: bool) -> None:
    """TF style: the wrapped optimizer raises; the scale and counter (or the backoff of a skip)
    are not advanced, so the retry is the first attempt."""
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = LossScaleOptimizer(_FailsOnce([w], lr=0.5), DynamicLossScale(8.0, increment_period=2))
    grad = torch.tensor([1.0, 3.0] if finite else [INF, 3.0])
    if finite:
        with pytest.raises(RuntimeError, match="transient failure"):
            opt.apply_gradients([(grad, w)])
        assert float(opt.loss_scale()) == 8.0 and int(opt.loss_scale.good_steps) == 0
    opt.apply_gradients([(grad, w)])
    expected = _unscaled_run([[1.0, 3.0]]) if finite else torch.tensor([1.0, 2.0])
    assert torch.equal(w.detach(), expected)
    assert float(opt.loss_scale()) == (8.0 if finite else 4.0)
    assert int(opt.loss_scale.good_steps) == (1 if finite else 0)


MISFIT_GRADS = [
    pytest.param(torch.ones(3), ValueError, "gradient shape", id="shape-finite"),
    pytest.param(torch.tensor([1.0, INF, 2.0]), ValueError, "gradient shape", id="shape-inf"),
    pytest.param(torch.ones(2, dtype=torch.float64), TypeError, "gradient dtype", id="dtype-finite"),
    pytest.param(torch.tensor([INF, 1.0], dtype=torch.float64), TypeError, "gradient dtype", id="dtype-inf"),
    pytest.param(
        torch.sparse_coo_tensor(
            torch.tensor([[0, 5]]), torch.tensor([INF, 1.0]), (2,), check_invariants=False
        ),
        ValueError,
        "row index 5 is out of range",
        id="sparse-row-out-of-range-inf",
    ),
]


@pytest.mark.parametrize(("grad", "exception", "words"), MISFIT_GRADS)
def test_apply_gradients_refuses_a_misfit_gradient_before_the_scale_changes(
    grad: Tensor, exception: type[Exception], words: str
) -> None:
    """A gradient that does not fit its variable raises whether or not it holds an inf: the
    scale neither backs off nor counts a good step, and no other variable moves."""
    w, v = nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.ones(3))
    opt = LossScaleOptimizer(tgo.GradientDescentOptimizer([v, w], 0.5), DynamicLossScale(8.0, 10))
    global_step = torch.zeros((), dtype=torch.int64)
    with pytest.raises(exception, match=words):
        opt.apply_gradients([(torch.ones(3), v), (grad, w)], global_step=global_step)
    assert float(opt.loss_scale()) == 8.0 and int(opt.loss_scale.good_steps) == 0
    assert torch.equal(v.detach(), torch.ones(3)) and torch.equal(w.detach(), torch.tensor([1.0, 2.0]))
    assert int(global_step) == 0


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize(("grad", "exception", "words"), MISFIT_GRADS[:4])
def test_step_refuses_a_misfit_p_grad_before_anything_changes(
    grad: Tensor, exception: type[Exception], words: str, steps_before: int, fused: bool
) -> None:
    """torch checks ``p.grad = ...`` but not ``p.grad.data = ...``: step() checks every p.grad
    before unscaling any, so the other gradients, the scale and the parameters stay as they were.
    Also after steps whose gradients fitted (what the checks found is kept between steps, and a
    fused step is then replayed)."""
    v, w = nn.Parameter(torch.ones(3)), nn.Parameter(torch.tensor([1.0, 2.0]))
    inner = tgo.GradientDescentOptimizer([v, w], 0.5, fused=fused)
    opt = LossScaleOptimizer(inner, DynamicLossScale(8.0, 10))
    for _ in range(steps_before):
        opt.zero_grad()
        opt.get_scaled_loss(v.sum() * 0.0 + w.sum() * 0.0).backward()
        opt.step()
    assert int(opt.loss_scale.good_steps) == steps_before
    opt.zero_grad()
    opt.get_scaled_loss(v.sum() + w.sum()).backward()
    w.grad.data = grad.clone()
    with pytest.raises(exception, match=words):
        opt.step()
    assert torch.equal(v.grad, torch.full((3,), 8.0))  # not unscaled
    assert float(opt.loss_scale()) == 8.0 and int(opt.loss_scale.good_steps) == steps_before
    assert torch.equal(v.detach(), torch.ones(3)) and torch.equal(w.detach(), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("between", ["unscale_", "step pre-hook", "global step pre-hook"])
def test_a_gradient_replaced_after_the_check_is_checked_again(between: str) -> None:
    """step() checks each p.grad once when the wrapped optimizer steps right after the check.
    One replaced after unscale_() or by a step pre-hook is checked again: here with the
    parameter's size in another shape, which the fused kernel, reading rows flattened, would
    apply element by element. The scale and the parameter stay as they were."""
    start = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    w = nn.Parameter(start.clone())
    inner = tgo.GradientDescentOptimizer([w], 0.5, fused=True)
    opt = LossScaleOptimizer(inner, DynamicLossScale(8.0, 10))
    opt.get_scaled_loss(w.sum()).backward()

    def replace(optimizer: Any, *_: Any) -> None:
        if optimizer is inner:
            w.grad.data = torch.ones(3, 2)

    handle = None
    if between == "unscale_":
        opt.unscale_()
        replace(inner)
    elif between == "step pre-hook":
        handle = inner.register_step_pre_hook(replace)
    else:
        handle = register_optimizer_step_pre_hook(replace)
    try:
        with pytest.raises(ValueError, match=r"shape \(3, 2\) does not match variable shape \(2, 3\)"):
            opt.step()
    finally:
        if handle is not None:
            handle.remove()
    assert float(opt.loss_scale()) == 8.0 and int(opt.loss_scale.good_steps) == 0
    assert torch.equal(w.detach(), start)


# ---------------------------------------------------------------------- misuse is loud
def _gd_on_w(scale: float = 8.0) -> tuple[nn.Parameter, LossScaleOptimizer]:
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    return w, LossScaleOptimizer(tgo.GradientDescentOptimizer([w], 0.5), DynamicLossScale(scale, 10))


def _slope_loss(w: Tensor) -> Tensor:
    return (w * torch.tensor([1.0, 3.0])).sum()


def _assert_untouched(w: Tensor, opt: LossScaleOptimizer, scale: float = 8.0) -> None:
    assert float(opt.loss_scale()) == scale and int(opt.loss_scale.good_steps) == 0
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))


def test_step_after_an_unscaled_backward_raises() -> None:
    """What a trainer that calls loss.backward() itself does: the update would be divided by
    the scale (here GD would move w by 0.5/8 instead of 0.5). It raises, naming the remedy."""
    w, opt = _gd_on_w()
    _slope_loss(w).backward()
    with pytest.raises(RuntimeError, match=r"step\(\): no backward pass went through opt.get_scaled_loss"):
        opt.step()
    assert torch.equal(w.grad, torch.tensor([1.0, 3.0]))  # not unscaled
    _assert_untouched(w, opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\): no backward pass .*loss.backward\(\)"):
        opt.unscale_()
    _assert_untouched(w, opt)


def test_a_scaled_loss_that_was_not_the_one_back_propagated_does_not_count() -> None:
    """get_scaled_loss called (e.g. for logging) but the unscaled loss back-propagated: raises."""
    w, opt = _gd_on_w()
    loss = _slope_loss(w)
    opt.get_scaled_loss(loss)
    loss.backward()
    with pytest.raises(RuntimeError, match="get_scaled_loss"):
        opt.step()
    _assert_untouched(w, opt)


@pytest.mark.parametrize("then", ["step", "apply_gradients"])
def test_a_second_update_on_the_same_gradients_raises(then: str) -> None:
    """step() twice without a new scaled backward pass would unscale and apply p.grad again."""
    w, opt = _gd_on_w()
    opt.get_scaled_loss(_slope_loss(w)).backward()
    if then == "step":
        opt.step()
    else:  # Keras's custom loop: unscale the scaled p.grad out of place and apply it
        opt.apply_gradients([(opt.get_unscaled_gradients([w.grad])[0], w)])
    after = w.detach().clone()
    assert torch.equal(after, torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match=r"since the last step\(\) .*: a second step\(\) would apply"):
        opt.step()
    assert torch.equal(w.detach(), after) and int(opt.loss_scale.good_steps) == 1
    opt.zero_grad()
    opt.get_scaled_loss(_slope_loss(w)).backward()
    opt.step()
    assert torch.equal(w.detach(), torch.tensor([0.0, -1.0]))


def test_zero_grad_forgets_the_scaled_backward() -> None:
    w, opt = _gd_on_w()
    opt.get_scaled_loss(_slope_loss(w)).backward()
    opt.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match=r"since zero_grad\(\)"):
        opt.step()
    _assert_untouched(w, opt)


def test_compute_gradients_does_not_count_as_a_scaled_backward() -> None:
    """compute_gradients scales its loss itself and leaves p.grad alone: a stale, unscaled
    p.grad is still refused by step()."""
    w, opt = _gd_on_w()
    _slope_loss(w).backward()
    pairs = opt.compute_gradients(_slope_loss(w))
    assert torch.equal(pairs[0][0], torch.tensor([1.0, 3.0]))
    with pytest.raises(RuntimeError, match="get_scaled_loss"):
        opt.step()
    _assert_untouched(w, opt)
    opt.minimize(lambda: _slope_loss(w))
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.5]))


def test_accumulating_scaled_micro_batches_then_one_step() -> None:
    """Several scaled backward passes, one step: the update of the summed loss."""
    w, opt = _gd_on_w()
    for slope in ([1.0, 3.0], [2.0, -1.0], [0.5, 0.5]):
        opt.get_scaled_loss((w * torch.tensor(slope)).sum()).backward()
    opt.step()
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]) - 0.5 * torch.tensor([3.5, 2.5]))


def test_autograd_grad_through_the_scaled_loss_counts() -> None:
    """Scaled gradients from torch.autograd.grad, put into p.grad by hand, then step()."""
    w, opt = _gd_on_w()
    (w.grad,) = torch.autograd.grad(opt.get_scaled_loss(_slope_loss(w)), [w])
    opt.step()
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.5]))


def test_a_closure_that_scales_and_back_propagates_counts() -> None:
    w, opt = _gd_on_w()

    def scaled_closure() -> Tensor:
        opt.zero_grad()
        loss = _slope_loss(w)
        opt.get_scaled_loss(loss).backward()
        return loss

    def unscaled_closure() -> Tensor:
        opt.zero_grad()
        loss = _slope_loss(w)
        loss.backward()
        return loss

    opt.step(scaled_closure)
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="get_scaled_loss"):
        opt.step(unscaled_closure)
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.5]))


class _DictCopyingProxy:
    """What Lightning's LightningOptimizer does: a subclass of the optimizer's class whose
    ``__dict__`` is a shallow copy of the optimizer's, and whose ``step`` calls the optimizer's."""

    def __init__(self, optimizer: LossScaleOptimizer) -> None:
        self.__dict__ = {**optimizer.__dict__, "_wrapped": optimizer}
        self.__class__ = type("Proxy", (_DictCopyingProxy, type(optimizer)), {})

    def step(self, closure: Any = None) -> Any:
        return self.__dict__["_wrapped"].step(closure)


def test_a_proxy_copying_the_optimizer_dict_shares_its_marks() -> None:
    """get_scaled_loss and unscale_() through the proxy, step() through it too: the gradients are
    unscaled once, and a second step raises."""
    w, opt = _gd_on_w()
    proxy: Any = _DictCopyingProxy(opt)
    proxy.get_scaled_loss(_slope_loss(w)).backward()
    proxy.unscale_()
    proxy.step()
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="get_scaled_loss"):
        proxy.step()


def test_a_copy_does_not_step_gradients_it_did_not_see_scaled() -> None:
    """A deep copy (or a pickle) starts with no scaled backward pass: gradients given to it
    afterwards need one, as after zero_grad()."""
    w, opt = _gd_on_w()
    opt.get_scaled_loss(_slope_loss(w)).backward()
    w_copy, opt_copy = copy.deepcopy((w, opt))
    w_copy.grad = w.grad.clone()  # deepcopy leaves .grad behind
    with pytest.raises(RuntimeError, match="get_scaled_loss"):
        opt_copy.step()
    opt.step()
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.5]))
