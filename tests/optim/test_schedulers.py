"""Every torch.optim.lr_scheduler class drives the optimizers of the table as it drives torch's own."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from optim_specs import SPECS, OptimSpec
from torch.optim import lr_scheduler as sched

import torchgrad_compat.optim as tgo

DEFAULT_CONFIGS = [(spec, next(iter(spec.configs))) for spec in SPECS]
DEFAULT_IDS = [spec.name.removesuffix("Optimizer") for spec, _ in DEFAULT_CONFIGS]
STEPS = 12

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda e: 1 / (1 + e)),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda e: 0.9),
    "StepLR": lambda o: sched.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ConstantLR": lambda o: sched.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.2, total_iters=5),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=6),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=4),
    "SequentialLR": lambda o: sched.SequentialLR(
        o, [sched.ConstantLR(o, factor=0.5, total_iters=3), sched.ExponentialLR(o, gamma=0.9)], milestones=[3]
    ),
    "ChainedScheduler": lambda o: sched.ChainedScheduler(
        [sched.ConstantLR(o, factor=0.5, total_iters=3), sched.ExponentialLR(o, gamma=0.9)]
    ),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, patience=1, factor=0.5),
    # Both cycle momentum by default (cycle_momentum=True).
    "CyclicLR": lambda o: sched.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=0.1, total_steps=STEPS + 1),
}

# The torch optimizer nearest to each of ours, for what a scheduler sees: the
# momentum key it may cycle (Adam's betas, SGD's and RMSprop's momentum) or its
# absence. GradientDescent has no momentum to cycle, so its reference is an
# optimizer without one (torch's SGD keeps a momentum of 0 that OneCycleLR
# would turn into heavy-ball momentum).
NEAREST: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "AdamOptimizer": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "MomentumOptimizer": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "RMSPropOptimizer": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
}
# Hyperparameter keys a scheduler may write, compared with the reference's.
CYCLED = {"AdamOptimizer": "betas", "MomentumOptimizer": "momentum", "RMSPropOptimizer": "momentum"}


def _reference(spec: OptimSpec, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    make = NEAREST.get(spec.name, lambda ps: torch.optim.Adagrad(ps, lr=0.1))
    opt = make(params)
    for group in opt.param_groups:
        group["lr"] = lr
    return opt


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in ((4, 3), (5,))]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _advance(s: Any, step: int) -> None:
    if isinstance(s, sched.ReduceLROnPlateau):
        s.step(1.0 if step < 3 else 2.0)  # a loss that stops improving
    else:
        s.step()


@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
@pytest.mark.parametrize(("spec", "cid"), DEFAULT_CONFIGS, ids=DEFAULT_IDS)
def test_scheduler_drives_the_group_as_with_torch(spec: OptimSpec, cid: str, sched_name: str):
    ours_params, ref_params = _params(), _params()
    ours = spec.make(ours_params, cid)
    ref = _reference(spec, ref_params, ours.param_groups[0]["lr"])
    make = SCHEDULERS[sched_name]
    try:
        ref_sched = make(ref)
    except ValueError as torch_error:
        with pytest.raises(ValueError) as ours_error:
            make(ours)
        assert str(ours_error.value) == str(torch_error)
        return
    with warnings.catch_warnings():
        # Any warning (e.g. "lr_scheduler.step() before optimizer.step()") is a difference from torch.
        warnings.simplefilter("error")
        ours_sched = make(ours)
        key = CYCLED.get(spec.name)
        for step in range(STEPS):
            assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"], step
            if key is not None:
                assert ours.param_groups[0][key] == ref.param_groups[0][key], step
            _set_grads(ours_params, step)
            _set_grads(ref_params, step)
            if spec.name == "FtrlOptimizer" and ref.param_groups[0]["lr"] == 0:
                # TF's Ftrl divides by the learning rate: a schedule that reaches 0 is refused, by name,
                # before the update (torch's Adagrad, its stand-in here, takes it).
                with pytest.raises(ValueError, match="Invalid learning_rate value: 0.0"):
                    ours.step()
                return
            ours.step()
            ref.step()
            _advance(ours_sched, step)
            _advance(ref_sched, step)
    assert ours_sched.state_dict().keys() == ref_sched.state_dict().keys()


def test_one_cycle_beta1_reaches_adams_update():
    # OneCycleLR writes group["betas"]; the update must use its beta1, exactly as
    # if the same sequence had been written to TF's group["beta1"] by hand.
    cycled_params, manual_params = _params(), _params()
    cycled = tgo.AdamOptimizer(cycled_params, learning_rate=0.01)
    manual = tgo.AdamOptimizer(manual_params, learning_rate=0.01)
    s = sched.OneCycleLR(cycled, max_lr=0.1, total_steps=STEPS + 1)
    beta1s = set()
    for step in range(STEPS):
        manual.param_groups[0]["lr"] = cycled.param_groups[0]["lr"]
        manual.param_groups[0]["beta1"] = cycled.param_groups[0]["betas"][0]
        beta1s.add(cycled.param_groups[0]["betas"][0])
        _set_grads(cycled_params, step)
        _set_grads(manual_params, step)
        cycled.step()
        manual.step()
        assert cycled.param_groups[0]["beta1"] == manual.param_groups[0]["beta1"]
        s.step()
    assert len(beta1s) > 5
    for c, m in zip(cycled_params, manual_params, strict=True):
        assert torch.equal(c, m)
    for c, m in zip(cycled.variables(), manual.variables(), strict=True):
        assert torch.equal(c, m)


def test_adam_betas_alias_follows_beta1_and_survives_a_state_dict():
    w = torch.zeros(3, requires_grad=True)
    opt = tgo.AdamOptimizer([{"params": [w], "betas": (0.8, 0.99)}], learning_rate=0.1)
    assert (opt.param_groups[0]["beta1"], opt.param_groups[0]["beta2"]) == (0.8, 0.99)
    opt.param_groups[0]["beta1"] = 0.7
    w.grad = torch.ones(3)
    opt.step()
    assert opt.param_groups[0]["betas"] == (0.7, 0.99)
    opt.param_groups[0]["betas"] = (0.6, 0.99)
    saved = opt.state_dict()["param_groups"][0]
    assert (saved["beta1"], saved["betas"]) == (0.6, (0.6, 0.99))
    fresh = tgo.AdamOptimizer([w], learning_rate=0.1)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["betas"] == (0.6, 0.99)


@pytest.mark.parametrize(
    ("group", "exc", "match"),
    [
        ({"betas": (0.9, 0.999), "beta1": 0.5}, ValueError, "both 'betas'"),
        ({"betas": (1.5, 0.999)}, ValueError, "Invalid beta1 value: 1.5"),
        ({"betas": 0.9}, TypeError, "betas must be a pair"),
    ],
)
def test_adam_betas_alias_is_checked(group, exc, match):
    with pytest.raises(exc, match=match):
        tgo.AdamOptimizer([{"params": [torch.zeros(1, requires_grad=True)], **group}])


def test_changing_both_betas_and_beta1_between_steps_is_an_error():
    w = torch.zeros(3, requires_grad=True)
    opt = tgo.AdamOptimizer([w])
    opt.param_groups[0]["betas"] = (0.5, 0.999)
    opt.param_groups[0]["beta1"] = 0.6
    w.grad = torch.ones(3)
    with pytest.raises(ValueError, match="changed both 'betas'"):
        opt.step()
