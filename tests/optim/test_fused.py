"""fused=True: the reference loop compiled by torch.compile, against the reference path and torch's rules.

The fused kernels take ``FUSED_CHUNK`` tensors a call; the tests use chunks of 4
(tests/conftest.py), so that a handful of parameters already spans full chunks, a
padded last chunk and the tensors the kernel leaves to the loop (one element, not
contiguous), and so that compiling stays quick.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from _deadlines import scaled
from optim_specs import FUSED_TOL, SPECS, OptimSpec
from torch._dynamo.utils import counters

import torchgrad_compat._torch_internals as torch_internals
import torchgrad_compat.optim as tgo
import torchgrad_compat.optim._census as optim_census
import torchgrad_compat.optim._fused.config as fused_config
import torchgrad_compat.optim._fused.kernel as fused_kernel
import torchgrad_compat.optim._fused.plan as fused_plan
import torchgrad_compat.optim._fused.run as fused_run
import torchgrad_compat.optim._hyper as optim_hyper
import torchgrad_compat.optim._numerics as optim_numerics
import torchgrad_compat.optim._slots as optim_slots
import torchgrad_compat.optim.optimizer as optim_optimizer
from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer

ALL_CONFIGS = [(spec, cid) for spec in SPECS for cid in spec.configs]
ALL_IDS = [f"{spec.name.removesuffix('Optimizer')}-{cid}" for spec, cid in ALL_CONFIGS]


def _bitwise_as_the_loop(spec: OptimSpec, cid: str, dtype: torch.dtype, device: str) -> bool:
    """Whether the fused kernels give the loop's bits: every op rounds as the loop's (the loop's
    square root is correctly rounded, as the compiled one is; on CUDA, see triton_options), but
    Ftrl's powers other than -0.5: Triton's pow on CUDA, and on the CPU a float64 pow (float32
    powers are taken in float64 and rounded on both paths, and agree)."""
    if "learning_rate_power" not in spec.configs[cid]:
        return True
    return device == "cpu" and dtype != torch.float64


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [(30, 10), (2000,), (1,), (5, 2, 3), (100,), (2, 2), (7, 3)]
STEPS = 3


@pytest.fixture(autouse=True)
def _no_counters():
    counters.clear()


def _run(spec: OptimSpec, cid: str, dtype: torch.dtype, device: str = "cpu", **path) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in SHAPES]
    opt = spec.make(params, cid, **path)
    for _ in range(STEPS):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen).to(device, dtype)
            # One gradient laid out transposed: the kernel takes it through the loop.
            p.grad = g.t().contiguous().t() if i == len(params) - 1 else g
        opt.step()
    return [p.detach().clone() for p in params] + [s.clone() for p in params for s in opt.state[p].values()]


@pytest.mark.parametrize(("spec", "cid"), ALL_CONFIGS, ids=ALL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
def test_fused_matches_the_reference_loop(spec: OptimSpec, cid: str, dtype: torch.dtype, device: str):
    fused = _run(spec, cid, dtype, device, fused=True)
    reference = _run(spec, cid, dtype, device, foreach=False)
    # Every kernel is called directly: none fell back to dynamo's per-call guards. On CPU, each
    # call goes to the one C++ function of the generated code, given the sizes of its rows.
    kernels = fused_kernel._FusedKernel._compiled.values()
    assert all(kernel.direct is not None for kernel in kernels)
    assert device != "cpu" or all(kernel.alone is not None for kernel in kernels)
    if _bitwise_as_the_loop(spec, cid, dtype, device):
        for f, r in zip(fused, reference, strict=True):
            assert torch.equal(f, r)
        return
    rtol, atol = FUSED_TOL[dtype]
    for f, r in zip(fused, reference, strict=True):
        torch.testing.assert_close(f, r, rtol=rtol, atol=atol)


def test_the_loops_square_root_is_correctly_rounded_as_the_compiled_one_is():
    """torch's eager CPU sqrt is not correctly rounded in every release (torch 2.13: an ulp off for
    about 17% of float32 inputs); the loop's (optim._numerics.sqrt) and the compiled kernel's are, so
    that the fused path gives the loop's bits. float32 against float64 (a faithful float64 root
    rounds to the correctly rounded float32 one), float64 against Python's math.sqrt."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(100_000, generator=gen) * 10.0 ** torch.randint(-8, 8, (100_000,), generator=gen)
    exact = x.double().sqrt().float()
    compiled = torch.compile(torch.sqrt, dynamic=True)(x)
    with torch.no_grad():
        ours, ours_in_place = optim_numerics.sqrt(x), optim_numerics.sqrt_(x.clone())
        ours_listed = [t.clone() for t in x.split(999)]
        optim_numerics.foreach_sqrt_(ours_listed)
    for result in (compiled, ours, ours_in_place, torch.cat(ours_listed)):
        assert torch.equal(result, exact)
    x64 = x[:5000].double() * (1 + 1e-9)
    with torch.no_grad():
        ours64 = optim_numerics.sqrt(x64)
    assert ours64.tolist() == [math.sqrt(v) for v in x64.tolist()]


def test_one_graph_across_steps_schedulers_loads_and_shapes():
    """Every chunk, step, learning rate and loaded checkpoint reuses one compiled graph."""
    # Graphs other tests compiled would be reused here.
    torch._dynamo.reset()
    fused_kernel._FusedKernel._compiled.clear()
    counters.clear()
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, 5), (7,), (4, 2, 3), (10,), (2, 2), (9, 9), (11,), (6, 1, 2), (5,), (3, 3, 3), (8,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = tgo.AdamOptimizer(params, learning_rate=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    for step in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        scheduler.step()
        if step == 2:
            opt.load_state_dict(opt.state_dict())
    assert counters["stats"]["unique_graphs"] == 1
    # Every call after the first went to Inductor's function directly, not through dynamo's guards.
    (kernel,) = fused_kernel._FusedKernel._compiled.values()
    assert kernel.direct is not None


def test_a_graph_whose_inputs_cannot_be_placed_runs_through_torch_compile(monkeypatch):
    """The fallback for a graph the direct call cannot feed: every call goes through dynamo, same numbers."""
    monkeypatch.setattr(fused_kernel._FusedKernel, "_compiled", {})
    monkeypatch.setattr(fused_kernel, "_placeholder_layout", lambda *args: None)
    spec = next(spec for spec in SPECS if spec.name == "MomentumOptimizer")
    cid = next(iter(spec.configs))
    fused = _run(spec, cid, torch.float32, fused=True)
    assert all(kernel.direct is None for kernel in fused_kernel._FusedKernel._compiled.values())
    for f, r in zip(fused, _run(spec, cid, torch.float32, foreach=False), strict=True):
        assert torch.equal(f, r)


def test_calls_through_the_generated_code_give_the_rows_of_its_kernel_alone(monkeypatch):
    """Without the C++ function taken alone (the generated code calls it), the same numbers."""
    spec = next(spec for spec in SPECS if spec.name == "MomentumOptimizer")
    cid = next(iter(spec.configs))
    alone = _run(spec, cid, torch.float32, fused=True)
    monkeypatch.setattr(fused_kernel._FusedKernel, "_compiled", {})
    monkeypatch.setattr(fused_kernel, "_kernel_alone", lambda *args: None)
    through = _run(spec, cid, torch.float32, fused=True)
    kernels = fused_kernel._FusedKernel._compiled.values()
    assert kernels and all(kernel.alone is None and kernel.inner is not None for kernel in kernels)
    for a, t, r in zip(alone, through, _run(spec, cid, torch.float32, foreach=False), strict=True):
        assert torch.equal(a, r) and torch.equal(t, r)


def test_calls_to_the_compiled_function_give_the_rows_of_the_generated_code(monkeypatch):
    """Without Inductor's generated code taken from under AOT autograd's wrappers, every call goes
    to the compiled function (which bumps the versions of what it writes): the same numbers."""
    spec = next(spec for spec in SPECS if spec.name == "MomentumOptimizer")
    cid = next(iter(spec.configs))
    monkeypatch.setattr(fused_kernel._FusedKernel, "_compiled", {})
    monkeypatch.setattr(fused_kernel, "_generated_call", lambda *args: None)
    direct = _run(spec, cid, torch.float32, fused=True)
    kernels = fused_kernel._FusedKernel._compiled.values()
    assert kernels and all(kernel.inner is None and kernel.direct is not None for kernel in kernels)
    for d, r in zip(direct, _run(spec, cid, torch.float32, foreach=False), strict=True):
        assert torch.equal(d, r)


def test_the_kernel_is_taken_alone_only_where_it_is_all_the_generated_code_does(monkeypatch):
    """The probe of the generated code refuses code that calls its C++ function twice, on a tensor
    it was not given, or does more than call it, and leaves the code's module as it was."""
    monkeypatch.setattr(fused_kernel._FusedKernel, "_compiled", {})
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 13)]
    opt = tgo.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, fused=True)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    (kernel,) = fused_kernel._FusedKernel._compiled.values()
    function, layout = kernel.alone, kernel.call_layout
    like = [params[0], params[0].grad, opt.state[params[0]]["momentum"]]
    scalars = {name: torch.tensor(0.5) for kind, name in kernel.layout if kind == "scalar"}
    # Where the generated code finds each of the function's arguments among its own.
    positions = [kernel.layout.index(entry) for entry in layout]

    def probe(body: str) -> Any:
        namespace = {"kernel": function, "positions": positions}
        exec(f"def call(args):\n    a = list(args)\n    args.clear()\n{body}", namespace)
        found = fused_kernel._kernel_alone(kernel, namespace["call"], like, scalars)
        assert namespace["kernel"] is function
        return found

    assert probe("    kernel(*[a[i] for i in positions])\n") == (function, layout)
    assert probe("    kernel(*[a[i] for i in positions])\n    kernel(*[a[i] for i in positions])\n") is None
    assert probe("    kernel(*[a[i].clone() if i == positions[0] else a[i] for i in positions])\n") is None
    assert probe("    kernel(*[a[i] for i in positions])\n    a[positions[0]].add_(1)\n") is None
    assert probe("    raise RuntimeError('not this time')\n") is None


def test_a_training_loop_step_checks_each_parameter_and_gradient_once(monkeypatch):
    """Once step()'s census has found the parameters and gradients as at the last step, and its
    check of the slots the slots, the fused plan checks none of them again (nothing has run in
    between that could change them)."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 13, 6, 7)]
    opt = tgo.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, fused=True)
    checked: list[int] = []
    holds = optim_census.SameMeta.holds
    monkeypatch.setattr(
        optim_census.SameMeta, "holds", lambda self, ts: checked.append(len(ts)) or holds(self, ts)
    )
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape)
        checked.clear()
        opt.step()
    assert checked == [2 * len(params), len(params)]
    # A callable hyperparameter runs between the checks and the update: everything is checked again.
    opt.param_groups[0]["lr"] = lambda: 0.1
    checked.clear()
    opt.step()
    assert checked == [2 * len(params), len(params), 3 * len(params)]


def _six_steps(
    spec: OptimSpec, cid: str, scale: float | None = None, fixed: bool = False
) -> list[torch.Tensor]:
    """Six fused steps of a training loop (new gradients, or written in place; one parameter
    frozen, without a gradient): every parameter and slot after them. ``scale``: inside a
    ``LossScaleOptimizer`` with a dynamic scale starting there (a power of two, which stays the
    scale over six steps) or, ``fixed``, that fixed scale, the gradients scaled by it; the
    gradients after the last step are then returned too."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES if s != (1,)]
    frozen = torch.nn.Parameter(torch.randn(6, generator=gen), requires_grad=False)
    opt = spec.make([*params[:2], frozen, *params[2:]], cid, fused=True)
    if scale is not None:
        opt = LossScaleOptimizer(opt, scale if fixed else DynamicLossScale(scale))
    for step in range(6):
        for p in params:
            g = torch.randn(p.shape, generator=gen) * (scale or 1.0)
            if p.grad is None or step % 2:
                p.grad = g
            else:
                p.grad.copy_(g)
        if scale is not None:
            # (step() asks for a backward pass through get_scaled_loss since the last one.)
            opt.get_scaled_loss(torch.zeros((), requires_grad=True)).backward()
        opt.step()
    params.append(frozen)
    slots = [s.clone() for p in params for s in opt.state[p].values()]
    grads = [p.grad.clone() for p in params if scale is not None and p.grad is not None]
    return [p.detach().clone() for p in params] + slots + grads


@pytest.mark.parametrize(("spec", "cid"), ALL_CONFIGS, ids=ALL_IDS)
def test_a_replayed_step_ends_as_the_whole_path(monkeypatch, spec: OptimSpec, cid: str):
    """Where a rule's later steps are replayed from the last one's record (see _StepReplay), they
    end bitwise as the steps that take the whole path at every step."""
    replayed = _six_steps(spec, cid)
    with _no_step_replay():
        whole = _six_steps(spec, cid)
    assert all(torch.equal(a, b) for a, b in zip(replayed, whole, strict=True))


def _count_whole_steps(monkeypatch) -> list[int]:
    """A list that gets an entry for each step that takes the whole path (Optimizer._apply), for
    the rest of the test; a replayed step adds none."""
    whole: list[int] = []
    apply = optim_optimizer.Optimizer._apply
    monkeypatch.setattr(
        optim_optimizer.Optimizer, "_apply", lambda self, *a: whole.append(1) or apply(self, *a)
    )
    return whole


@contextlib.contextmanager
def _no_step_replay():
    previous = tgo.set_step_replay(False)
    try:
        yield
    finally:
        tgo.set_step_replay(previous)


@pytest.mark.parametrize(("spec", "cid"), ALL_CONFIGS, ids=ALL_IDS)
@pytest.mark.parametrize(
    ("scale", "fixed"), [(None, False), (2.0**10, False), (1000.0, True)], ids=["bare", "dynamic", "fixed"]
)
def test_a_training_loop_takes_the_whole_path_twice_then_replays(
    monkeypatch, spec: OptimSpec, cid: str, scale: float | None, fixed: bool
):
    """The step that makes the slots takes the whole path, the next one too (its slots were not
    there to be checked) and is recorded; the following steps replay it. Also inside a
    LossScaleOptimizer, which checks and unscales the gradients first (dynamic) or leaves that
    to the kernels (fixed); the replayed steps end bitwise as steps that take the whole path."""
    whole = _count_whole_steps(monkeypatch)
    replayed = _six_steps(spec, cid, scale, fixed)
    assert len(whole) == (2 if spec.slots else 1)
    with _no_step_replay():
        again = _six_steps(spec, cid, scale, fixed)
    assert all(torch.equal(a, b) for a, b in zip(replayed, again, strict=True))
    assert len(whole) == (2 if spec.slots else 1) + 6


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_a_replayed_step_runs_without_grad_and_leaves_grad_mode_as_it_found_it(grad_mode: bool):
    """A replayed step turns grad mode off for its kernels (with it on, run_fused takes the reference
    loop) and gives it back as it was, also when the step fails."""
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(6)]
    opt = tgo.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, fused=True)
    seen = []
    rule = opt._apply_dense

    def watching(*args):
        seen.append(torch.is_grad_enabled())
        return rule(*args)

    opt._apply_dense = watching
    with torch.set_grad_enabled(grad_mode):
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(64)
            opt.step()
            assert torch.is_grad_enabled() is grad_mode
        assert seen == [False] * 4 and opt.__dict__.get("_step_replay") is not None
        opt._apply_dense = lambda *args: (_ for _ in ()).throw(RuntimeError("rule failed"))
        with pytest.raises(RuntimeError, match="rule failed"):
            opt.step()
        assert torch.is_grad_enabled() is grad_mode


def test_a_scalar_a_rule_computes_at_each_step_is_not_replayed_stale(monkeypatch):
    """A replayed step updates through the rule's own ``_apply_dense`` (see _StepReplay), so a
    scalar the rule computes afresh at each step, from anything at all, is computed again: here
    GradientDescent's rule halves its learning rate at every call, from a count of its own, as a
    kept number tensor (the kind of scalar a record of the last step's kernel arguments would
    have passed again unchanged)."""
    rule = tgo.GradientDescentOptimizer._apply_dense
    calls = []

    def halving(self, group, params, grads, slots, non_slot, hyper, path):
        calls.append(path)
        lr = hyper.tensor(group["lr"] * 0.5 ** (len(calls) - 1))
        rule(self, group, params, grads, slots, non_slot, _With(hyper, lr=lr), path)

    monkeypatch.setattr(tgo.GradientDescentOptimizer, "_apply_dense", halving)
    whole = _count_whole_steps(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES if s != (1,)]
    expected = [p.detach().clone() for p in params]
    opt = tgo.GradientDescentOptimizer(params, learning_rate=0.5, fused=True)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g, e in zip(params, grads, expected, strict=True):
            p.grad = g
            e.sub_(torch.tensor(0.5 * 0.5**step) * g)
        opt.step()
    assert all(torch.equal(p.detach(), e) for p, e in zip(params, expected, strict=True))
    assert len(whole) == 1 and len(calls) == 5  # (four steps replayed)


def test_a_hyperparameter_tensor_written_after_a_replayed_step_is_made_again(monkeypatch):
    """A replayed step hands the rule the hyperparameter tensors its record kept (see _StepReplay)
    only while nothing has written to them: one written in place after a replayed step sends the
    next step down the whole path, which makes the tensor again from the group's number."""
    rule = tgo.GradientDescentOptimizer._apply_dense
    seen = []

    def watching(self, group, params, grads, slots, non_slot, hyper, path):
        seen.append(hyper.lr)
        rule(self, group, params, grads, slots, non_slot, hyper, path)

    monkeypatch.setattr(tgo.GradientDescentOptimizer, "_apply_dense", watching)
    whole = _count_whole_steps(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES if s != (1,)]
    expected = [p.detach().clone() for p in params]
    opt = tgo.GradientDescentOptimizer(params, learning_rate=0.375, fused=True)
    for step in range(5):
        for p, e in zip(params, expected, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            e.sub_(p.grad * torch.tensor(0.375))
        opt.step()
        if step == 2:
            seen[-1].fill_(4.0)
    assert all(torch.equal(p.detach(), e) for p, e in zip(params, expected, strict=True))
    assert len(whole) == 2 and len(seen) == 5  # (steps 1, 2 and 4 replayed)
    assert seen[3] is not seen[2] and seen[4] is seen[3] and seen[3].item() == 0.375


class _With:
    """``hyper`` with some of its scalars replaced."""

    def __init__(self, hyper: Any, **scalars: torch.Tensor):
        self._hyper, self._scalars = hyper, scalars

    def __getattr__(self, name: str) -> Any:
        return self._scalars[name] if name in self._scalars else getattr(self._hyper, name)


@pytest.mark.parametrize(("spec", "cid"), ALL_CONFIGS, ids=ALL_IDS)
def test_a_fixed_loss_scale_is_unscaled_inside_the_fused_pass_bitwise(monkeypatch, spec: OptimSpec, cid: str):
    """Inside a LossScaleOptimizer with a fixed scale, every rule's fused kernels multiply each
    gradient by the float32 reciprocal of the scale in their own pass and write it back: the
    parameters, slots and gradients end bitwise as after torch's check-and-unscale pass and the
    same fused steps. (1000 is not a power of two: its reciprocal rounds.)"""
    rules = []
    unscaling = fused_run._unscaling
    monkeypatch.setattr(fused_run, "_unscaling", lambda single: rules.append(single) or unscaling(single))
    inside = _six_steps(spec, cid, 1000.0, fixed=True)
    assert rules
    rules.clear()
    monkeypatch.setattr(LossScaleOptimizer, "_unscaled_inside", lambda self, *args: False)
    apart = _six_steps(spec, cid, 1000.0, fixed=True)
    assert not rules
    assert all(torch.equal(a, b) for a, b in zip(inside, apart, strict=True))


@pytest.mark.parametrize("path", [{"fused": True}, {"foreach": False}], ids=["fused", "loop"])
def test_a_loaded_state_lets_go_of_the_slots_it_replaces(path: dict[str, bool]):
    """What a step keeps to find the slots again holds no slot of an earlier state once another
    is loaded."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9)]
    opt = tgo.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, **path)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    replaced = [weakref.ref(opt.state[p]["momentum"]) for p in params]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    gc.collect()
    assert all(ref() is None for ref in replaced)


def _moved_between_steps(**path: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """Three Momentum steps; before the third, a parameter and a slot are moved to new memory
    through ``.data``. Returns the parameters and slots, the memory they left, and the plan kept
    after the second step and after the third (None off the fused path)."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (5, 9, 13, 6, 7)]
    opt = tgo.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, **path)
    plans, left = [], []
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 2:
            slot = opt.state[params[3]]["momentum"]
            left = [params[1].data, slot.data]
            params[1].data, slot.data = params[1].data.clone(), slot.data.clone()
            left = [t.clone() for t in left] + left
        opt.step()
        plans.append(fused_plan._FusedPlan._kept.get(opt.state[params[0]]["momentum"]))
    return [p.detach() for p in params] + [opt.state[p]["momentum"] for p in params], left, plans[1:]


def test_memory_moved_under_a_tensor_is_updated_where_it_is_now_by_the_same_plan():
    """On CPU each kernel call takes this step's tensors as they are: the kept plan holds none of
    them and depends on their sizes and layouts alone, so a parameter or slot moved to new memory
    is updated there, by the same plan, with the loop's numbers, and the memory it left is not
    written."""
    fused, left, plans = _moved_between_steps(fused=True)
    loop, _, _ = _moved_between_steps(foreach=False)
    assert plans[0] is not None and plans[0] is plans[1]
    assert plans[0].as_they_are and not plans[0].aliases
    assert all(torch.equal(f, r) for f, r in zip(fused, loop, strict=True))
    before, after = left[:2], left[2:]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


@pytest.mark.parametrize(("spec", "cid"), ALL_CONFIGS, ids=ALL_IDS)
def test_what_the_fillers_hold_does_not_reach_the_rows(spec: OptimSpec, cid: str):
    """The tensors that fill up a last chunk are never zeroed again: whatever earlier calls left
    in them (NaN, infinities) changes nothing of the rows."""
    results = []
    for poison in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5,), (9,), (3, 4))]
        opt = spec.make(params, cid, fused=True)
        for _ in range(STEPS):
            if poison:
                for lists in fused_plan._FUSED_FILLERS.values():
                    for fillers in lists:
                        for i, t in enumerate(fillers):
                            t.fill_((math.nan, math.inf, -math.inf)[i % 3])
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        results.append(
            [p.detach().clone() for p in params] + [s.clone() for p in params for s in opt.state[p].values()]
        )
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


_BETWEEN_STEPS = [
    "new gradients",
    "a gradient None",
    "a parameter moved",
    "a parameter reshaped",
    "a gradient moved",
    "a slot replaced",
    "a slot moved",
    "slots replaced",
    "slots deleted",
    "state loaded",
    "lr changed",
    "lr callable",
    "group added",
    "gradients zeroed in place",
    "lr the same number again",
    "momentum changed",
    "nesterov switched on",
    "a parameter replaced in its group",
    "fused switched off",
    "lr a tensor",
]


def _steps_with_random_changes(seed: int, **path: Any) -> tuple[list[str], list[torch.Tensor]]:
    """Eight Momentum steps with a random change before each of the last six: what each step
    did, and every parameter and slot after them."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (rng.randint(2, 9),) if rng.random() < 0.6 else (rng.randint(2, 4), rng.randint(2, 4))
        for _ in range(7)
    ]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = tgo.MomentumOptimizer(params[:-1], learning_rate=0.1, momentum=0.9, **path)
    done: list[str] = []
    for step in range(8):
        change = rng.choice(_BETWEEN_STEPS) if step >= 2 else "new gradients"
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            if p.grad is None or change == "new gradients" or rng.random() < 0.5:
                p.grad = g
            else:
                p.grad.copy_(g)
        p = params[rng.randrange(len(params) - 1)]
        state = opt.state.get(p)
        if change == "a gradient None":
            p.grad = None
        elif change == "a parameter moved":
            p.data = p.data.clone()
        elif change == "a parameter reshaped" and p.dim() == 1 and p.numel() % 2 == 0:
            p.data, p.grad = p.data.view(2, -1), p.grad.view(2, -1)
        elif change == "a gradient moved":
            p.grad.data = p.grad.data.clone()
        elif change == "a slot replaced" and state:
            state["momentum"] = state["momentum"] * 0.5
        elif change == "a slot moved" and state:
            state["momentum"].data = state["momentum"].data - 1
        elif change == "slots replaced" and state:
            opt.state[p] = {"momentum": state["momentum"] + 1}
        elif change == "slots deleted" and state:
            del opt.state[p]
        elif change == "state loaded":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        elif change == "lr changed":
            opt.param_groups[0]["lr"] = rng.uniform(0.05, 0.15)
        elif change == "lr callable":
            opt.param_groups[0]["lr"] = lambda: 0.07
        elif change == "group added" and len(opt.param_groups) == 1:
            opt.add_param_group({"params": [params[-1]], "lr": 0.2})
        elif change == "gradients zeroed in place":
            opt.zero_grad(set_to_none=False)
            for q in params:
                if q.grad is not None:
                    q.grad.add_(1.0)
        elif change == "lr the same number again" and not callable(opt.param_groups[0]["lr"]):
            opt.param_groups[0]["lr"] = float(str(float(opt.param_groups[0]["lr"])))
        elif change == "momentum changed":
            opt.param_groups[0]["momentum"] = rng.uniform(0.5, 0.95)
        elif change == "nesterov switched on":
            opt.param_groups[0]["use_nesterov"] = True
        elif change == "a parameter replaced in its group":
            group = opt.param_groups[0]["params"]
            i = rng.randrange(len(group))
            j = next(j for j, q in enumerate(params) if q is group[i])
            group[i] = params[j] = torch.nn.Parameter(group[i].detach() + 1)
            group[i].grad = torch.randn(group[i].shape, generator=gen)
        elif change == "fused switched off":
            opt.param_groups[0]["fused"] = False
        elif change == "lr a tensor":
            opt.param_groups[0]["lr"] = torch.tensor(rng.uniform(0.05, 0.15))
        try:
            opt.step()
        except (ValueError, TypeError, RuntimeError) as error:
            return [*done, f"{change}: {type(error).__name__}: {error}"], []
        done.append(change)
    return done, [q.detach().clone() for q in params] + [
        s["momentum"].clone() for q in params for s in [opt.state.get(q, {})] if "momentum" in s
    ]


@pytest.mark.parametrize("seed", range(12))
def test_random_changes_between_steps_end_as_the_loop_with_nothing_kept(monkeypatch, seed: int):
    """Whatever a training loop changes between steps, the fused steps, with everything they keep
    from one step to the next, end bitwise as the reference loop that keeps nothing."""
    fused = _steps_with_random_changes(seed, fused=True)
    monkeypatch.setattr(optim_census.SameMeta, "of", classmethod(lambda cls, tensors: None))
    monkeypatch.setattr(optim_slots, "slot_dicts_as_kept", lambda opt, grouped: None)
    loop = _steps_with_random_changes(seed, foreach=False)
    assert fused[0] == loop[0]
    assert len(fused[1]) == len(loop[1])
    for a, b in zip(fused[1], loop[1], strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


_CONV_SHAPES = [(8, 3, 3, 3), (4, 8, 3, 3), (8,), (2, 4, 3, 3, 3)]


def _run_conv(spec: OptimSpec, cid: str, channels_last: bool, **path) -> tuple[list[torch.Tensor], Any]:
    """Conv-like parameters, in channels_last(_3d) or contiguous; gradients and slots laid out as them."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in _CONV_SHAPES]
    if channels_last:
        for p in params:
            if p.dim() > 1:
                fmt = torch.channels_last if p.dim() == 4 else torch.channels_last_3d
                p.data = p.data.to(memory_format=fmt)
    opt = spec.make(params, cid, **path)
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=gen))
        opt.step()
    return params, opt


@pytest.mark.parametrize(("spec", "cid"), ALL_CONFIGS, ids=ALL_IDS)
def test_channels_last_rows_go_through_the_kernels_in_memory_order(spec: OptimSpec, cid: str):
    """A parameter, gradient and slots all dense in one channels-last format are updated flat, in
    memory order: every row goes through the kernels, with the numbers of the same tensors laid
    out contiguously, and of the loop, bitwise (float32)."""
    params, opt = _run_conv(spec, cid, True, fused=True)
    assert params[0].grad.is_contiguous(memory_format=torch.channels_last)
    first_slot = next(iter(opt.state[params[0]].values()), params[0])
    plan = fused_plan._FusedPlan._kept[first_slot]
    assert plan.chunks and not plan.loop_rows
    fused = [p.detach().clone() for p in params] + [s.clone() for p in params for s in opt.state[p].values()]
    contiguous_params, contiguous_opt = _run_conv(spec, cid, False, fused=True)
    loop_params, loop_opt = _run_conv(spec, cid, True, foreach=False)
    for params_b, opt_b in ((contiguous_params, contiguous_opt), (loop_params, loop_opt)):
        other = [p.detach() for p in params_b] + [s for p in params_b for s in opt_b.state[p].values()]
        for f, o in zip(fused, other, strict=True):
            assert torch.equal(f, o)


def test_a_gradient_laid_out_otherwise_than_its_channels_last_parameter_takes_the_loop():
    """Step by step the gradient of a channels-last parameter is channels-last, contiguous, then
    channels-last again: each step pairs the right elements (the loop's numbers, bitwise)."""
    runs = []
    for path in ({"fused": True}, {"foreach": False}):
        gen = torch.Generator().manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in _CONV_SHAPES[:3]]
        for p in params[:2]:
            p.data = p.data.to(memory_format=torch.channels_last)
        opt = tgo.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, **path)
        for step in range(4):
            for p in params:
                g = torch.randn(p.shape, generator=gen)
                p.grad = g.contiguous() if step in (1, 3) else torch.empty_like(p).copy_(g)
            opt.step()
        runs.append([p.detach().clone() for p in params] + [opt.state[p]["momentum"] for p in params])
    for f, r in zip(*runs, strict=True):
        assert torch.equal(f, r)


def test_kept_flat_aliases_follow_replaced_parameters_and_slots():
    """Each step updates what parameters and slots hold now: after p.data = ..., a load, a transpose."""
    runs = []
    for path in ({"fused": True}, {"foreach": False}):
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        opt = tgo.AdamOptimizer(params, learning_rate=0.1, **path)
        trace = []
        for step in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            trace.append([p.detach().clone() for p in params])
            if step == 1:
                params[0].data = params[0].data * 2
            if step == 2:
                params[5].data = params[5].data.t()  # (2, 2): same memory, no longer contiguous
            if step == 3:
                state = opt.state_dict()
                for s in state["state"].values():
                    s["m"] = s["m"] * 0.5
                opt.load_state_dict(state)
        runs.append(trace)
    for fused, loop in zip(*runs, strict=True):
        for f, r in zip(fused, loop, strict=True):
            assert torch.equal(f, r)


def test_a_kept_plan_serves_later_steps_and_goes_with_its_optimizer():
    """One plan serves step after step with new gradients; it does not keep a dropped optimizer's slots."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = tgo.AdamOptimizer(params, learning_rate=0.1, fused=True)
    plans = []
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
        plans.append(fused_plan._FusedPlan._kept[opt.state[params[0]]["m"]])
    assert plans[0] is plans[1]
    plan = weakref.ref(plans.pop())
    plans.clear()
    del opt
    gc.collect()
    assert plan() is None


def test_fused_functional_form_over_no_tensors_does_nothing():
    from torchgrad_compat.optim.adam import adam

    t = torch.tensor(0.1)
    adam([], [], [], [], alpha=t, one_minus_beta1=t, one_minus_beta2=t, epsilon=t, foreach=False, fused=True)


def test_fused_functional_form_with_grad_mode_on_acts_as_the_loop():
    """A leaf that requires grad is refused, as by the loop; nothing moves."""
    from torchgrad_compat.optim.gradient_descent import gradient_descent

    params = [torch.randn(40, requires_grad=True) for _ in range(3)]
    before = [p.detach().clone() for p in params]
    for path in ({"foreach": False}, {"foreach": False, "fused": True}):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            gradient_descent(params, [torch.ones(40)] * 3, lr=torch.tensor(0.5), **path)
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("first", [(1,), ()], ids=["one-element", "0-d"])
def test_fused_functional_form_refuses_a_hyperparameter_of_more_than_one_element(first):
    """The loop broadcasts a learning rate shaped like the parameter; the kernels read one value.
    After a call with one element, a kept kernel took the next call's per-element rates as the
    first rate for every element: refused instead, before anything moves."""
    from torchgrad_compat.optim.gradient_descent import gradient_descent

    p, g = torch.ones(37), torch.full((37,), 2.0)
    with torch.no_grad():
        gradient_descent([p], [g], lr=torch.full(first, 0.5), foreach=False, fused=True)
        assert torch.equal(p, torch.zeros(37))
        for lr in (torch.rand(37), torch.rand(1, 37), torch.ones(0)):
            words = f"lr must be a tensor of one element, got shape {tuple(lr.shape)}"
            with pytest.raises(ValueError, match=re.escape(words)):
                gradient_descent([p], [g], lr=lr, foreach=False, fused=True)
            assert torch.equal(p, torch.zeros(37))


@pytest.mark.parametrize(
    ("grads", "ms", "words"),
    [
        pytest.param(
            [40, 20, 40], [40, 40, 40], r"gradient 1 .*shape=\(20,\).* its parameter has 40", id="short-grad"
        ),
        pytest.param([40, 40, 80], [40, 40, 40], r"gradient 2 .*shape=\(80,\)", id="long-grad"),
        pytest.param(
            [40, "f64", 40], [40, 40, 40], r"gradient 1 .*float64.*gradient 0 is torch.float32", id="f64-grad"
        ),
        pytest.param([40, 40, 40], [40, 40, 10], r"slot 2 .*shape=\(10,\)", id="short-slot"),
        pytest.param(
            [40, (8, 5), 40],
            [40, 40, 40],
            r"gradient 1 .*shape=\(8, 5\).* has shape \(40,\)",
            id="reshaped-grad",
        ),
        pytest.param([40, 40, 40], [40, (40, 1), 40], r"slot 1 .*shape=\(40, 1\)", id="reshaped-slot"),
        pytest.param([40, 40], [40, 40, 40], "2 gradients for 3 parameters", id="missing-grad"),
    ],
)
def test_fused_functional_form_refuses_rows_that_do_not_fit(grads, ms, words):
    """The kernels take each row as long as its parameter and of its list's dtype: a row that
    differs would be read or written past its end, and one of another shape, flattened, would
    be applied where the loop refuses it. The functional form checks before anything moves."""
    from torchgrad_compat.optim.adam import adam

    params = [torch.ones(40) for _ in range(3)]
    gs = [torch.ones(40, dtype=torch.float64) if n == "f64" else torch.ones(n) for n in grads]
    # (The loop refuses a row of its parameter's size in another shape: its ops do not broadcast.)
    m, v = [torch.zeros(n) for n in ms], [torch.zeros(40) for _ in range(3)]
    one = torch.tensor(1.0)
    with torch.no_grad(), pytest.raises(ValueError, match=words):
        adam(
            params,
            gs,
            m,
            v,
            alpha=one * 0.1,
            one_minus_beta1=one * 0.1,
            one_minus_beta2=one * 0.001,
            epsilon=one * 1e-8,
            foreach=False,
            fused=True,
        )
    assert all(torch.equal(p, torch.ones(40)) for p in params)
    assert all(not t.any() for t in m + v)


def test_one_tensor_under_two_hyperparameters_leaves_the_kernel_right_for_later_steps(monkeypatch):
    """A user's 0-d tensor passed as both learning rate and momentum: dynamo would make one graph
    input of it, and the kernel, kept for every later Momentum optimizer, would read one value
    for both (off by up to 8.6 after three steps). Each hyperparameter stays its own input."""
    monkeypatch.setattr(fused_kernel._FusedKernel, "_compiled", {})

    def run(lr, momentum, **path):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(40, generator=gen)) for _ in range(6)]
        opt = tgo.MomentumOptimizer(params, learning_rate=lr, momentum=momentum, **path)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(40, generator=gen)
            opt.step()
        return torch.cat([p.detach() for p in params])

    shared = torch.tensor(0.5)
    assert torch.equal(run(shared, shared, fused=True), run(shared, shared, foreach=False))
    assert torch.equal(run(0.01, 0.9, fused=True), run(0.01, 0.9, foreach=False))


def test_a_fused_step_under_inference_mode_leaves_later_steps_working(monkeypatch):
    """The tensors that fill a last chunk up are shared by every later step of the process: made
    under inference mode, zeroing them outside it would fail."""
    monkeypatch.setattr(fused_plan, "_FUSED_FILLERS", {})
    w = torch.nn.Parameter(torch.randn(10))
    w.grad = torch.ones(10)
    with torch.inference_mode():
        tgo.GradientDescentOptimizer([w], 0.1, fused=True).step()
    runs = []
    for path in ({"fused": True}, {"foreach": False}):
        params = [torch.nn.Parameter(torch.arange(10.0) + i) for i in range(3)]
        opt = tgo.GradientDescentOptimizer(params, 0.1, **path)
        for p in params:
            p.grad = torch.ones(10)
        opt.step()
        runs.append(torch.cat([p.detach() for p in params]))
    assert torch.equal(*runs)


def test_weights_tied_through_a_transpose_are_updated_in_the_loops_order():
    """The transposed one takes the loop, the other a kernel: the loop's rows go first, so rows
    sharing memory with one of them take the loop too, and the updates keep the list's order."""
    runs = []
    for path in ({"fused": True}, {"foreach": False}):
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(16, 16, generator=gen)
        others = [torch.nn.Parameter(torch.randn(8, generator=gen)) for _ in range(5)]
        params = [torch.nn.Parameter(weight), *others, torch.nn.Parameter(weight.t())]
        opt = tgo.GradientDescentOptimizer(params, learning_rate=0.1, **path)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append([weight.clone(), *(p.detach().clone() for p in others)])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_a_parameter_offloaded_and_reloaded_at_the_same_address_gets_a_new_plan():
    """Offloading frees a parameter's memory with ``untyped_storage().resize_(0)`` (the plan's alias
    shares that storage) and reloads it into a new tensor, which for 64 MiB the allocator puts at
    the same address: the kept plan would write through the freed alias (a segmentation fault)."""
    size = 1 << 24
    runs = []
    for path in ({"fused": True}, {"foreach": False}):
        gen = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(64, generator=gen)),
            torch.nn.Parameter(torch.randn(size, generator=gen)),
        ]
        opt = tgo.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, **path)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if step == 1:
                p = params[1]
                saved = p.detach().clone()
                p.untyped_storage().resize_(0)
                p.data = torch.empty(size)
                p.data.copy_(saved)
                del saved
            opt.step()
        runs.append([p.detach().clone() for p in params] + [opt.state[p]["momentum"] for p in params])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", [{"fused": True}, {"foreach": False}], ids=["fused", "loop"])
def test_slots_made_under_inference_mode_are_ordinary_tensors(path: dict[str, bool]):
    """A parameter whose first gradient came under inference mode gets slots that a later step
    outside it may update: as inference tensors, that step raised after other slots had moved."""
    runs = []
    for inference in (True, False):
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 40) * (i + 1)) for i in range(4)]
        opt = tgo.AdamOptimizer(params, 0.1, **path)
        params[0].grad = torch.ones(40)
        opt.step()
        with torch.inference_mode() if inference else contextlib.nullcontext():
            params[0].grad = None
            for p in params[1:]:
                p.grad = torch.ones(40)
            opt.step()
        slots = [s for p in params for s in opt.state[p].values()]
        assert not any(t.is_inference() for t in slots)
        for p in params:
            p.grad = torch.full((40,), 0.5)
        opt.step()
        runs.append([t.detach().clone() for t in params + slots])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_each_list_is_filled_up_in_its_own_dtype():
    """The functional form takes slots of another dtype than the parameters (the loop computes in
    both); the kernel reads every row of a list as that list's dtype, the filling ones too (rows
    of the parameters' dtype would be read past their end)."""
    from torchgrad_compat.optim.adam import adam

    one = torch.tensor(1.0)
    scalars = {
        "alpha": one * 0.1,
        "one_minus_beta1": one * 0.1,
        "one_minus_beta2": one * 0.001,
        "epsilon": one * 1e-8,
    }
    runs = []
    for fused in (True, False):
        params = [torch.linspace(-1, 1, 40) for _ in range(5)]
        m = [torch.zeros(40, dtype=torch.float64) for _ in range(5)]
        v = [torch.zeros(40, dtype=torch.float64) for _ in range(5)]
        with torch.no_grad():
            adam(params, [torch.ones(40)] * 5, m, v, foreach=False, fused=fused, **scalars)
        runs.append(params + m + v)
        if fused:
            filled = fused_plan._FusedPlan._kept[m[0]].filled
            missing = -5 % fused_config.FUSED_CHUNK
            assert sorted(filled) == [0, 1, 2, 3] and all(len(f) == missing for f in filled.values())
            for j, like in enumerate((params, None, m, v)):
                if like is not None:
                    assert all(t.dtype == like[0].dtype for t in filled[j])
    assert all(torch.equal(f, r) for f, r in zip(*runs, strict=True))


@NEEDS_CUDA
def test_a_row_past_int32_indexing_is_updated_on_cuda():
    """Triton kernels compiled for small sizes index in 32 bits; a parameter of more than 2**31
    elements goes through the loop instead of being left as it was."""
    numel = 2**31 + 8192
    if torch.cuda.mem_get_info()[0] < 5 * 4 * numel:  # the parameter, its gradient, the loop's temporaries
        pytest.skip("needs 43 GB of free GPU memory")
    w = torch.nn.Parameter(torch.ones(numel, device="cuda"))
    opt = tgo.GradientDescentOptimizer(
        [w, torch.nn.Parameter(torch.ones(10, device="cuda"))], 0.5, fused=True
    )
    w.grad = torch.ones_like(w)
    opt.step()
    assert bool((w == 0.5).all())


def test_fused_under_the_callers_torch_compile():
    """Inside a compiled train step the update is traced into the caller's graph: no nested compile."""
    results = []
    for path in ({"fused": True}, {"foreach": False}):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4))
        opt = tgo.MomentumOptimizer([w], learning_rate=0.1, momentum=0.9, **path)
        x = torch.linspace(0, 1, 8).reshape(2, 4)

        def train_step(w=w, opt=opt, x=x):
            opt.zero_grad()
            (x @ w.t()).square().sum().backward()
            opt.step()

        step = torch.compile(train_step) if path.get("fused") else train_step
        for _ in range(3):
            step()
        results.append(w.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_fused_and_foreach_together_are_refused_as_torch_does():
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"`fused` and `foreach` cannot be `True` together"):
        tgo.AdamOptimizer([w], fused=True, foreach=True)
    with pytest.raises(TypeError, match=r"fused must be None or a bool, got 'yes'"):
        tgo.AdamOptimizer([w], fused="yes")
    opt = tgo.AdamOptimizer([w])
    with pytest.raises(RuntimeError, match=r"`fused` and `foreach` cannot be `True` together"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "fused": True, "foreach": True})


def test_fused_refuses_a_device_without_generated_kernels():
    w = torch.nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(
        RuntimeError, match=r"`fused=True` requires parameters on cpu or cuda .* got one on meta"
    ):
        tgo.GradientDescentOptimizer([w], learning_rate=0.1, fused=True)


def test_sparse_gradients_keep_their_path_under_fused():
    results = []
    for path in ({"fused": True}, {"foreach": False}):
        emb = torch.nn.Parameter(torch.linspace(0, 1, 12).reshape(4, 3))
        dense = torch.nn.Parameter(torch.linspace(1, 2, 6))
        opt = tgo.AdamOptimizer([emb, dense], learning_rate=0.1, **path)
        for _ in range(2):
            opt.zero_grad()
            loss = torch.nn.functional.embedding(torch.tensor([1, 3, 1]), emb, sparse=True).sum()
            (loss + dense.square().sum()).backward()
            opt.step()
        results.append((emb.detach().clone(), dense.detach().clone()))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-7)


def test_a_state_dict_without_the_fused_flag_loads_and_steps():
    """Older state_dicts lack the key: torch fills missing flags with the defaults, and so do these."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = tgo.AdamOptimizer([w], learning_rate=0.1)
    w.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        del group["fused"]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["fused"] is None
    w.grad = torch.ones(4)
    opt.step()


@NEEDS_CUDA
@pytest.mark.parametrize(("spec", "cid"), ALL_CONFIGS, ids=ALL_IDS)
def test_fused_on_cuda_matches_the_cpu_reference_loop(spec: OptimSpec, cid: str):
    def run(device: str, **path) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]
        opt = spec.make(params, cid, **path)
        for _ in range(STEPS):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            opt.step()
        return [p.detach().cpu() for p in params]

    for f, r in zip(run("cuda", fused=True), run("cpu", foreach=False), strict=True):
        torch.testing.assert_close(f, r, rtol=1e-5, atol=1e-6)


@NEEDS_CUDA
@pytest.mark.parametrize(("spec", "cid"), ALL_CONFIGS, ids=ALL_IDS)
def test_cuda_graph_replays_match_the_reference_loop(spec: OptimSpec, cid: str):
    """Gradients written into the same tensors at every step stay where they are, so from the
    third step on the fused step is a CUDA graph replayed; the learning rate changes in
    between. Parameters and slots are the reference loop's, as without a graph, and a
    parameter saved for backward is seen as modified in place, as after any step."""

    def run(**path) -> tuple[list[torch.Tensor], Any]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in SHAPES]
        grads = [torch.empty(p.shape, device="cuda") for p in params]
        opt = spec.make(params, cid, **path)
        for step in range(6):
            for p, g in zip(params, grads, strict=True):
                g.copy_(torch.randn(p.shape, generator=gen))
                p.grad = g
            if step == 4:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * 0.5
            opt.step()
        saved = (params[0] * params[0]).sum()  # saves params[0] for backward
        for p, g in zip(params, grads, strict=True):
            g.copy_(torch.randn(p.shape, generator=gen))
            p.grad = g
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()
        kept = [fused_plan._FusedPlan._kept.get(t) for t in [params[0], *opt.state[params[0]].values()]]
        graphs = [graph for plan in kept if plan is not None for graph in plan.graphs]
        slots = [s.clone() for p in params for s in opt.state[p].values()]
        return [p.detach().clone() for p in params] + slots, graphs

    fused, graphs = run(fused=True)
    reference, _ = run(foreach=False)
    # Captured at the third step (the second, where an earlier test compiled the kernel) and
    # replayed at every step from then on.
    assert len(graphs) == 1 and graphs[0].replays >= 5
    if "learning_rate_power" not in spec.configs[cid]:
        for f, r in zip(fused, reference, strict=True):
            assert torch.equal(f, r)
    else:  # Triton's pow is not CUDA's
        rtol, atol = FUSED_TOL[torch.float32]
        for f, r in zip(fused, reference, strict=True):
            torch.testing.assert_close(f, r, rtol=rtol, atol=atol)


def _train_on_cuda(spec: OptimSpec, layers: int, steps: int, **path: Any) -> tuple[torch.nn.Module, Any]:
    """``steps`` steps of a stack of ``layers`` Linear(64, 64) layers on CUDA, as a training loop does
    them: ``zero_grad()`` frees the gradients and backward makes new ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)]).cuda()
    opt = spec.make(list(model.parameters()), **path)
    x = torch.randn(16, 64, device="cuda")
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).tanh().square().mean().backward()
        opt.step()
    return model, opt


@NEEDS_CUDA
@pytest.mark.parametrize("spec", SPECS, ids=[spec.name.removesuffix("Optimizer") for spec in SPECS])
def test_a_training_loop_replays_the_fused_step_on_cuda(spec: OptimSpec):
    """``zero_grad()`` frees the gradients and backward makes new ones, which the caching allocator
    puts where the last ones were as long as nothing the step keeps comes from their pool: the
    state a step replaces (Adam's beta powers, AdagradDA's step) and the graph's own inputs.
    So one graph is captured at the third step and replayed from then on."""

    def run(**path) -> tuple[list[torch.Tensor], list[int]]:
        model, opt = _train_on_cuda(spec, layers=12, steps=12, **path)
        first = next(iter(model.parameters()))
        kept = [fused_plan._FusedPlan._kept.get(t) for t in [first, *opt.state[first].values()]]
        replays = [graph.replays for plan in kept if plan is not None for graph in plan.graphs]
        return [p.detach().clone() for p in model.parameters()], replays

    fused, replays = run(fused=True)
    reference, _ = run(foreach=False)
    assert len(replays) == 1 and replays[0] >= 10, replays
    cid = next(iter(spec.configs))
    rtol, atol = FUSED_TOL[torch.float32] if "learning_rate_power" in spec.configs[cid] else (0, 0)
    for f, r in zip(fused, reference, strict=True):
        torch.testing.assert_close(f, r, rtol=rtol, atol=atol)


@NEEDS_CUDA
def test_a_cpu_learning_rate_is_read_at_every_step_on_cuda():
    """The functional form takes a CPU 0-d learning rate beside CUDA rows; a CUDA graph would keep
    the value it was captured with, so such steps are not replayed."""
    from torchgrad_compat.optim.gradient_descent import gradient_descent

    runs = []
    for fused in (True, False):
        params = [torch.ones(s, device="cuda") for s in SHAPES]
        grads = [torch.ones(s, device="cuda") for s in SHAPES]
        for step in range(6):
            with torch.no_grad():
                gradient_descent(params, grads, lr=torch.tensor(0.1 * (step + 1)), foreach=False, fused=fused)
        runs.append(params)
    for f, r in zip(*runs, strict=True):
        assert torch.equal(f, r)


_STREAM_ORDERED_LOOP = """
import torch
from optim_specs import FUSED_TOL, SPECS
from test_fused import _train_on_cuda

assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
for spec in SPECS:
    runs = []
    for path in ({"fused": True}, {"foreach": False}):
        model, opt = _train_on_cuda(spec, layers=4, steps=6, **path)
        runs.append([p.detach().clone() for p in model.parameters()])
    cid = next(iter(spec.configs))
    rtol, atol = FUSED_TOL[torch.float32] if "learning_rate_power" in spec.configs[cid] else (0, 0)
    for f, r in zip(*runs, strict=True):
        torch.testing.assert_close(f, r, rtol=rtol, atol=atol)
    first = next(iter(model.parameters()))
    plans = [fused_plan._FusedPlan._kept.get(t) for t in [first, *opt.state[first].values()]]
    assert not any(plan.graphs for plan in plans if plan is not None)
print("all", len(SPECS), "match")
"""


@NEEDS_CUDA
def test_the_fused_step_under_the_stream_ordered_allocator_matches_the_loop_on_cuda():
    """``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` is chosen when the process starts: a
    capture of the fused step aborted the process under it, so there the kernels are called
    one at a time (no graph), with the loop's numbers."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _STREAM_ORDERED_LOOP],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"all {len(SPECS)} match" in done.stdout


@pytest.mark.parametrize("spec", SPECS, ids=[spec.name.removesuffix("Optimizer") for spec in SPECS])
def test_a_fused_step_is_seen_by_autograd_as_an_in_place_update(spec: OptimSpec):
    """The kernels write through raw pointers; the step bumps the version counter of every
    parameter and slot it writes, so a parameter saved for backward before it is refused after."""
    params = [torch.nn.Parameter(torch.linspace(0.5, 1.5, 40).reshape(5, 8) * (k + 1)) for k in range(3)]
    opt = spec.make(params, fused=True)
    for _ in range(2):
        saved = (params[0] * params[0]).sum()  # saves params[0] for backward
        for p in params:
            p.grad = torch.full_like(p, 0.25)
        slots = list(opt.state[params[0]].values())
        versions = [t._version for t in [params[0], *slots]]
        opt.step()
        assert all(t._version > v for t, v in zip([params[0], *slots], versions, strict=True)), spec.name
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()


@pytest.mark.parametrize("new", [torch.ones(8, dtype=torch.float64), torch.ones(2)], ids=["float64", "short"])
def test_a_gradient_replaced_by_a_callable_hyperparameter_is_refused(new: torch.Tensor):
    """A TF-style callable hyperparameter is evaluated after step() has checked the gradients;
    one that replaces a gradient's data (``.data``: torch checks nothing) must not reach the
    kernels, which would read it as float32 or past its end."""
    params = [torch.nn.Parameter(torch.zeros(8)) for _ in range(2)]

    def learning_rate() -> float:
        params[1].grad.data = new.clone()
        return 1.0

    opt = tgo.GradientDescentOptimizer(params, learning_rate=learning_rate, fused=True)
    for p in params:
        p.grad = torch.ones(8)
    with pytest.raises(ValueError, match="gradient 1"):
        opt.step()
    assert not params[1].detach().any()


def test_probes_of_the_generated_call_in_two_threads_leave_inductor_as_it_was():
    """Finding the generated call patches CompiledFxGraph.__call__ for a moment; two probes at
    once (two first fused steps in two threads) must not leave one's patch installed, which
    would keep every input of every later compiled call alive."""
    from torch._inductor.output_code import CompiledFxGraph

    real = CompiledFxGraph.__call__
    # A kernel over one parameter row and one gradient row, with the row's size.
    kernel = types.SimpleNamespace(layout=[("row", (0, 0)), ("row", (1, 0)), ("size", 0)])
    like = [torch.zeros(2), torch.zeros(2)]
    a_inside, a_done = threading.Event(), threading.Event()

    def compiled_a(*args: Any) -> None:
        a_inside.set()
        time.sleep(0.2)

    def compiled_b(*args: Any) -> None:
        a_done.wait(timeout=scaled(5))

    def probe_a() -> None:
        fused_kernel._generated_call(kernel, compiled_a, like, {})
        a_done.set()

    first = threading.Thread(target=probe_a)
    first.start()
    assert a_inside.wait(timeout=scaled(5))
    second = threading.Thread(target=fused_kernel._generated_call, args=(kernel, compiled_b, like, {}))
    second.start()
    first.join(timeout=scaled(10))
    second.join(timeout=scaled(10))
    assert CompiledFxGraph.__call__ is real


def test_fused_resumes_bitwise_from_a_state_dict():
    grads = [torch.sin(torch.arange(60.0) * (k + 1)).reshape(6, 10) for k in range(4)]

    def steps(opt: tgo.Optimizer, w: torch.Tensor, ks: range) -> None:
        for k in ks:
            w.grad = grads[k].clone()
            opt.step()

    w = torch.nn.Parameter(torch.linspace(-1, 1, 60).reshape(6, 10))
    opt = tgo.AdamOptimizer([w], learning_rate=0.1, fused=True)
    steps(opt, w, range(2))
    saved = copy.deepcopy((w.detach(), opt.state_dict()))
    steps(opt, w, range(2, 4))

    resumed = torch.nn.Parameter(saved[0].clone())
    opt = tgo.AdamOptimizer([resumed], learning_rate=0.1, fused=True)
    opt.load_state_dict(saved[1])
    steps(opt, resumed, range(2, 4))
    assert torch.equal(resumed, w)


def test_loss_scale_optimizer_around_a_fused_optimizer_skips_and_applies_as_the_loop():
    results = []
    for path in ({"fused": True}, {"foreach": False}):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 40))
        opt = LossScaleOptimizer(tgo.AdamOptimizer([w], learning_rate=0.1, **path), DynamicLossScale(64.0, 2))
        for k in range(4):
            opt.zero_grad()
            loss = (w * w).sum() * (float("inf") if k == 1 else 1.0)
            opt.get_scaled_loss(loss).backward()
            opt.step()
        results.append((w.detach().clone(), float(opt.loss_scale())))
    assert results[0][1] == results[1][1] == 64.0  # halved at the inf, doubled after two good steps
    assert torch.isfinite(results[0][0]).all()
    assert torch.equal(results[0][0], results[1][0])


def test_agn_workers_and_server_with_fused_optimizers_step_as_the_loop():
    """Two AGN workers (period 2, in-process server) with fused Adam locally and on the server."""
    from torchgrad_compat.agn import AGNOptimizer, LocalServerHost, ParameterServer

    def run(**path) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(2)
        start = [torch.randn(s, generator=gen) for s in SHAPES]
        server = ParameterServer(
            [t.clone() for t in start], lambda ps: tgo.AdamOptimizer(ps, learning_rate=0.05, **path), 2
        )
        host = LocalServerHost()
        host.start(server)
        params = [[torch.nn.Parameter(t.clone()) for t in start] for _ in range(2)]
        workers = [
            AGNOptimizer(
                tgo.AdamOptimizer(ps, learning_rate=0.1, **path), 2, 2, server=host.endpoint(f"w{i}")
            )
            for i, ps in enumerate(params)
        ]
        for k in range(8):
            ps = params[k % 2]
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            workers[k % 2].step()
        assert server.global_step == 4
        return [c.clone() for c in server.center] + [p.detach().clone() for ps in params for p in ps]

    for f, r in zip(run(fused=True), run(foreach=False), strict=True):
        assert torch.equal(f, r)


def test_half_precision_working_copies_are_made_a_chunk_at_a_time(monkeypatch):
    """bfloat16 parameters go through float32 copies: never of the whole bucket at once."""
    sizes: list[int] = []
    apply_dense = tgo.AdamOptimizer._apply_dense

    def recording(self, group, params, grads, slots, non_slot, hyper, path):
        sizes.append(sum(p.numel() for p in params))
        return apply_dense(self, group, params, grads, slots, non_slot, hyper, path)

    monkeypatch.setattr(tgo.AdamOptimizer, "_apply_dense", recording)
    results = []
    for path in ({"fused": True}, {"foreach": False}):
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(200_000, generator=gen).bfloat16()) for _ in range(4)]
        opt = tgo.AdamOptimizer(params, learning_rate=0.1, **path)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
        results.append(torch.cat([p.detach() for p in params]))
    # 200k bfloat16 elements are 400 KB: one tensor per 512 KiB chunk, on both paths.
    assert sizes == [200_000] * 8
    torch.testing.assert_close(results[0], results[1], rtol=1.6e-2, atol=1e-5)


def test_the_cuda_options_turn_off_contraction_and_round_division():
    """Read from Inductor's own Triton code generator (no GPU needed): under the options the CUDA
    kernels are compiled with, no multiply-add contraction and division rounded to nearest;
    under Inductor's defaults, neither (what fused=True on CUDA measured before the options:
    GradientDescent differed from the loop in 25% of the elements)."""
    pytest.importorskip("torch._inductor.codegen.triton")
    known = torch._inductor.config.get_config_copy()
    if not {"eager_numerics.division_rounding", "emulate_divison_rounding"} & set(known):
        pytest.skip(f"torch {torch.__version__}: Inductor has no division-rounding option (fused=True warns)")
    assert torch_internals.triton_rounds_as_eager(torch_internals.triton_options(fused_config.FUSED_CHUNK))
    assert not torch_internals.triton_rounds_as_eager({})


def test_kept_metadata_tells_apart_every_property_the_checks_read():
    """A step whose tensors are as at the last one skips reading their properties in Python; what
    tells it so must see every property those reads would: on the torch this is tested with, the
    one-call check is in use, and each change below is told apart."""
    assert torch_internals.tensor_guards() is not None
    torch_internals.tensor_guards.cache_clear()  # (as if the first step ran under inference mode)
    with torch.inference_mode():
        assert torch_internals.tensor_guards() is not None
    like = torch.zeros(4, 6)
    kept = optim_census.SameMeta.of([like])
    assert kept is not None and kept.holds([torch.ones(4, 6)])
    with torch.inference_mode():
        inference = torch.zeros(4, 6)
    others = {
        "shape": torch.zeros(6, 4),
        "rank": torch.zeros(4, 6, 1),
        "dtype": torch.zeros(4, 6, dtype=torch.float64),
        "bfloat16 bits": torch.zeros(4, 6, dtype=torch.float16).view(torch.bfloat16),
        "strides": torch.zeros(6, 4).t(),
        "requires_grad": torch.zeros(4, 6, requires_grad=True),
        "subclass": torch.nn.Parameter(torch.zeros(4, 6), requires_grad=False),
        "sparse": torch.zeros(4, 6).to_sparse(),
        "inference": inference,
        "meta": torch.zeros(4, 6, device="meta"),
        "not a tensor": None,
    }
    for what, other in others.items():
        assert not kept.holds([other]), what
    assert not kept.holds([like, like]) and not kept.holds([])


def _changed_after_two_steps(opt_of: Any, change: str) -> tuple[str, list[torch.Tensor]]:
    """Two steps, ``change``, a third step: what it raised, else every parameter and slot after it."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(8,), (2, 4), (2, 3, 2, 2), (5,), (3, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    replace_in_lr = [False]

    def learning_rate() -> float:
        if replace_in_lr[0]:
            params[1].grad.data = torch.ones(3)
        return 0.1

    # (A number otherwise: a callable learning rate makes every step check every tensor.)
    opt = opt_of(params, learning_rate if change == "gradient replaced by the learning rate" else 0.1)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 2:
            p = params[1]
            if change == "gradient shape":
                p.grad.data = torch.ones(3)
            elif change == "gradient dtype":
                p.grad.data = p.grad.data.double()
            elif change == "gradient transposed":
                p.grad = p.grad.t().contiguous().t()
            elif change == "gradient sparse":
                p.grad = p.grad.to_sparse(1)
            elif change == "gradient channels-last":
                params[2].grad = params[2].grad.contiguous(memory_format=torch.channels_last)
            elif change == "parameter channels-last":
                params[2].data = params[2].data.contiguous(memory_format=torch.channels_last)
                params[2].grad = params[2].grad.contiguous(memory_format=torch.channels_last)
            elif change == "parameter dtype":
                p.data, p.grad = p.data.double(), p.grad.double()
            elif change == "parameter reshaped":
                p.data, p.grad = p.data.view(8), p.grad.view(8)
            elif change == "parameter moved":
                p.data = p.data.clone()
            elif change == "gradient replaced by the learning rate":
                replace_in_lr[0] = True
            elif change == "parameter replaced in its group":
                group = opt.param_groups[0]["params"]
                group[1] = params[1] = torch.nn.Parameter(p.detach() * 2)
                params[1].grad = p.grad
            elif change == "learning rate changed":
                opt.param_groups[0]["lr"] = 0.25
            elif change == "learning rate tensor written in place":
                # (Where a step takes its hyperparameters from: one written is made again.)
                optim_hyper.number_tensor(0.1, torch.float32, torch.device("cpu")).fill_(0.5)
            elif change == "group key added":
                opt.param_groups[0]["weight_decay"] = 0.01
            elif change == "betas changed":
                opt.param_groups[0]["betas"] = (0.8, 0.99)
            elif change == "beta1 changed":
                opt.param_groups[0]["beta1"] = 0.5
            elif change == "beta1_power replaced":
                opt.param_groups[0]["beta1_power"] = torch.tensor(0.5)
            elif change == "beta1_power written in place":
                opt.param_groups[0]["beta1_power"].fill_(0.5)
            elif change == "beta1_power out of range":
                opt.param_groups[0]["beta1_power"] = torch.tensor(1.5)
            elif change == "state loaded":
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            elif change.startswith("slot"):
                state = opt.state[p]
                if change == "slot replaced":
                    state["momentum"] = state["momentum"].clone()
                elif change == "slot moved":
                    state["momentum"].data = state["momentum"].data.clone()
                elif change == "slot dtype":
                    state["momentum"] = state["momentum"].double()
                elif change == "slot transposed":
                    state["momentum"] = state["momentum"].t().contiguous().t()
                elif change == "slot transposed in place":
                    state["momentum"].data = state["momentum"].data.t()
                elif change == "slots replaced":
                    opt.state[p] = {"momentum": state["momentum"].clone()}
                elif change == "slot renamed":
                    state["accumulation"] = state.pop("momentum")
        try:
            opt.step()
        except (ValueError, TypeError, RuntimeError) as error:
            return f"{type(error).__name__}: {error}", []
    return "", [p.detach().clone() for p in params] + [
        s.clone() for p in params for s in opt.state[p].values()
    ]


_CHANGES = [
    "gradient shape",
    "gradient dtype",
    "gradient transposed",
    "gradient sparse",
    "gradient channels-last",
    "parameter channels-last",
    "parameter dtype",
    "parameter reshaped",
    "parameter moved",
    "gradient replaced by the learning rate",
    "slot replaced",
    "slot moved",
    "slot dtype",
    "slot transposed",
    "slot transposed in place",
    "slots replaced",
    "slot renamed",
    "parameter replaced in its group",
    "learning rate changed",
    "learning rate tensor written in place",
    "group key added",
]
_REFUSED = {
    "gradient shape",
    "gradient dtype",
    "gradient replaced by the learning rate",
    "group key added",
}


_ADAM_CHANGES = [
    "learning rate changed",
    "betas changed",
    "beta1 changed",
    "beta1_power replaced",
    "beta1_power written in place",
    "beta1_power out of range",
    "state loaded",
    "parameter moved",
    "gradient dtype",
]


@pytest.mark.parametrize("change", _ADAM_CHANGES)
def test_an_adam_step_after_its_state_changed_ends_as_the_whole_path(monkeypatch, change: str):
    """Adam's fused steps are replayed with the beta powers they advance: a third step after a
    change to its hyperparameters, its non-slot state or its tensors ends as it does when nothing
    was kept (refused with the same words, or with the same numbers, bitwise)."""

    def opt_of(params: list[torch.Tensor], lr: Any) -> tgo.AdamOptimizer:
        return tgo.AdamOptimizer(params, learning_rate=lr, fused=True)

    kept = _changed_after_two_steps(opt_of, change)
    monkeypatch.setattr(optim_census.SameMeta, "of", classmethod(lambda cls, tensors: None))
    monkeypatch.setattr(optim_slots, "slot_dicts_as_kept", lambda opt, grouped: None)
    checked_in_full = _changed_after_two_steps(opt_of, change)
    assert kept[0] == checked_in_full[0]
    assert bool(kept[0]) == (change in ("gradient dtype", "beta1_power out of range")), kept[0]
    assert len(kept[1]) == len(checked_in_full[1])
    assert all(torch.equal(a, b) for a, b in zip(kept[1], checked_in_full[1], strict=True))


@pytest.mark.parametrize("change", _CHANGES)
@pytest.mark.parametrize(
    ("opt_of", "has_slots"),
    [
        (lambda ps, lr: tgo.MomentumOptimizer(ps, learning_rate=lr, momentum=0.9, fused=True), True),
        (lambda ps, lr: tgo.MomentumOptimizer(ps, learning_rate=lr, momentum=0.9, foreach=False), True),
        (lambda ps, lr: tgo.GradientDescentOptimizer(ps, learning_rate=lr, fused=True), False),
    ],
    ids=["Momentum-fused", "Momentum-loop", "GradientDescent-fused"],
)
def test_a_step_after_its_tensors_changed_is_checked_as_a_first_step(
    monkeypatch, opt_of: Any, has_slots: bool, change: str
):
    """After two steps the checks keep what they found; a third step whose parameters, gradients
    or slots were changed in between must end as it does when nothing was kept: refused with the
    same words, or with the same numbers, bitwise."""
    if change.startswith("slot") and not has_slots:
        pytest.skip("GradientDescent keeps no slots")
    kept = _changed_after_two_steps(opt_of, change)
    monkeypatch.setattr(optim_census.SameMeta, "of", classmethod(lambda cls, tensors: None))
    monkeypatch.setattr(optim_slots, "slot_dicts_as_kept", lambda opt, grouped: None)
    checked_in_full = _changed_after_two_steps(opt_of, change)
    assert kept[0] == checked_in_full[0]
    # (Slots keep their variable's dtype and shape: a converted or reshaped variable or slot is refused.)
    refused = _REFUSED | (
        {"parameter dtype", "parameter reshaped", "slot transposed in place", "slot dtype", "slot renamed"}
        if has_slots
        else set()
    )
    assert bool(kept[0]) == (change in refused), kept[0]
    assert len(kept[1]) == len(checked_in_full[1])
    for a, b in zip(kept[1], checked_in_full[1], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
