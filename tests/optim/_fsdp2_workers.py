"""The rank side of tests/optim/test_fsdp2.py: FSDP2, DCP and ZeroRedundancyOptimizer checks in gloo
processes.

Each check runs many configurations in one process group, since starting the
processes is what costs. Every rank trains on the same batch, so FSDP2's
averaged, reduce-scattered gradient ((g + g) / 2) is the unsharded gradient
exactly, and the sharded update can be compared with a single-process
reference run on the full model, element for element.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _fused_engine import use_small_chunks
from _procs import init_gloo
from optim_specs import spec_configs
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import torchgrad_compat.optim as tgo
from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer

STEPS, SPLIT = 5, 3
# TF parity tolerance for float32 (DESIGN.md), for the TF-style check. The sharded
# steps are compared bitwise: the gradient is the unsharded one exactly and every
# rule is elementwise, so any difference is a sharding bug (measured: 0 over all
# 40 configurations, parameters, slots and non-slot state).
RTOL, ATOL = 1e-5, 1e-6


def _model(seed: int = 0) -> nn.Module:
    # Linear(5, 1)'s weight has one row: with two ranks, rank 1's shard of it is empty.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))


def _sharded(seed: int = 0) -> nn.Module:
    model = _model(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    return ((model(x) - y) ** 2).mean()


def _train(model: nn.Module, opt: Any, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss = _loss(model, step)
        if isinstance(opt, LossScaleOptimizer):
            loss = opt.get_scaled_loss(loss)
        loss.backward()
        opt.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _snapshot(model: nn.Module, opt: Any) -> list[tuple[str, torch.Tensor]]:
    out = [(name, _full(p)) for name, p in model.named_parameters()]
    local = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    if isinstance(local, LossScaleOptimizer) and isinstance(local.inner_optimizer, ZeroRedundancyOptimizer):
        out.extend(("loss_scale", v.clone()) for v in local.loss_scale.variables())
        local = local.inner_optimizer.optim
    variables = local.variables() if hasattr(local, "variables") else []
    out.extend((f"variable{i}", _full(v)) for i, v in enumerate(variables))
    return out


def _assert_bitwise(label: str, a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b], label
    for (name, x), (_, y) in zip(a, b, strict=True):
        assert torch.equal(x, y), f"{label}: {name} differs after resuming"


def _lso_adam(params):
    return LossScaleOptimizer(
        tgo.AdamOptimizer(params, learning_rate=0.01),
        DynamicLossScale(initial_loss_scale=8, increment_period=2),
    )


def _configs(foreach_too: bool) -> list[tuple[str, Callable]]:
    out = []
    for spec, cid in spec_configs():
        for foreach in (False, True) if foreach_too else (None,):
            label = f"{spec.name}-{cid}-foreach={foreach}"
            out.append((label, lambda ps, s=spec, c=cid, f=foreach: s.make(ps, c, foreach=f)))
    return out


# ---------------------------------------------------------------- checks
def check_fsdp2_steps_match_unsharded(rank: int, world: int, tmp: Path) -> None:
    """Every optimizer, both paths, steps on FSDP2 shards exactly as the unsharded run does;
    fused=True too, for a rule with a square root and one without (chunks of 4: quick to compile)."""
    use_small_chunks()
    fused = [
        ("Adam-fused", lambda ps: tgo.AdamOptimizer(ps, learning_rate=0.01, fused=True)),
        ("Momentum-fused", lambda ps: tgo.MomentumOptimizer(ps, 0.1, 0.9, use_nesterov=True, fused=True)),
    ]
    failures = []
    for label, make in [*_configs(foreach_too=True), *fused]:
        sharded, reference = _sharded(), _model()
        opt, ref_opt = make(list(sharded.parameters())), make(list(reference.parameters()))
        _train(sharded, opt, range(STEPS))
        _train(reference, ref_opt, range(STEPS))
        for (name, got), (_, want) in zip(
            _snapshot(sharded, opt), _snapshot(reference, ref_opt), strict=True
        ):
            if not torch.equal(got, want):
                failures.append(f"{label} {name}: max |diff| {(got - want).abs().max().item()}")
        # Slots are sharded as their parameter (DCP saves each rank's shard).
        for p in sharded.parameters():
            assert all(isinstance(opt.get_slot(p, name), DTensor) for name in opt.get_slot_names()), label
    assert not failures, "\n".join(failures)


def check_dcp_resume_under_fsdp2(rank: int, world: int, tmp: Path) -> None:
    """DCP get_state_dict/dcp.save, then dcp.load/set_state_dict into fresh FSDP2 models: bitwise."""
    configs = [
        *_configs(foreach_too=False),
        ("Adam-foreach", lambda ps: tgo.AdamOptimizer(ps, learning_rate=0.01, foreach=True)),
        ("LossScale-Adam", _lso_adam),
    ]
    for i, (label, make) in enumerate(configs):
        path = tmp / f"dcp{i}"
        model = _sharded()
        opt = make(list(model.parameters()))
        _train(model, opt, range(SPLIT))
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        _train(model, opt, range(SPLIT, STEPS))
        expected = _snapshot(model, opt)

        fresh_model = _sharded(seed=1)
        fresh = make(list(fresh_model.parameters()))
        model_sd, optim_sd = get_state_dict(fresh_model, fresh)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(fresh_model, fresh, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _train(fresh_model, fresh, range(SPLIT, STEPS))
        _assert_bitwise(label, _snapshot(fresh_model, fresh), expected)


def check_full_state_dict_resume_under_fsdp2(rank: int, world: int, tmp: Path) -> None:
    """Full (gathered, unsharded) state dicts, got and set on every rank: bitwise."""
    save = StateDictOptions(full_state_dict=True)
    load = StateDictOptions(full_state_dict=True)
    configs = [
        ("Adam", lambda ps: tgo.AdamOptimizer(ps, learning_rate=0.01)),
        ("AdagradDA", lambda ps: tgo.AdagradDAOptimizer(ps, learning_rate=0.1)),
        ("LossScale-Adam", _lso_adam),
    ]
    for label, make in configs:
        model = _sharded()
        opt = make(list(model.parameters()))
        _train(model, opt, range(SPLIT))
        model_sd, optim_sd = get_state_dict(model, opt, options=save)
        _train(model, opt, range(SPLIT, STEPS))
        expected = _snapshot(model, opt)

        fresh_model = _sharded(seed=1)
        fresh = make(list(fresh_model.parameters()))
        set_state_dict(fresh_model, fresh, model_state_dict=model_sd, optim_state_dict=optim_sd, options=load)
        _train(fresh_model, fresh, range(SPLIT, STEPS))
        _assert_bitwise(label, _snapshot(fresh_model, fresh), expected)


def _zero(spec, cid):
    return lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=spec.cls, **spec.configs[cid])


def _lso_zero_adam(params):
    zero = ZeroRedundancyOptimizer(params, optimizer_class=tgo.AdamOptimizer, learning_rate=0.01)
    return LossScaleOptimizer(zero, DynamicLossScale(initial_loss_scale=8, increment_period=2))


def _zero_of(opt):
    return opt.inner_optimizer if isinstance(opt, LossScaleOptimizer) else opt


def check_zero_resume(rank: int, world: int, tmp: Path) -> None:
    """ZeroRedundancyOptimizer: consolidate on rank 0, torch.save, every rank loads it: bitwise."""
    configs = [(f"{spec.name}-{cid}", _zero(spec, cid)) for spec, cid in spec_configs()]
    configs.append(("LossScale-ZeRO-Adam", _lso_zero_adam))
    for i, (label, make) in enumerate(configs):
        path = tmp / f"zero{i}.pt"
        model = _model()
        opt = make(list(model.parameters()))
        _train(model, opt, range(SPLIT))
        _zero_of(opt).consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        dist.barrier()
        _train(model, opt, range(SPLIT, STEPS))
        expected = _snapshot(model, opt)

        fresh_model = _model(seed=1)
        fresh = make(list(fresh_model.parameters()))
        saved = torch.load(path, weights_only=True)
        fresh_model.load_state_dict(saved["model"])
        fresh.load_state_dict(saved["optim"])
        _train(fresh_model, fresh, range(SPLIT, STEPS))
        _assert_bitwise(label, _snapshot(fresh_model, fresh), expected)


def check_tf_style_under_fsdp2(rank: int, world: int, tmp: Path) -> None:
    """compute_gradients cannot see FSDP2's gradients (autograd.grad): a clear error, nothing changed."""
    model = _sharded()
    opt = tgo.AdamOptimizer(list(model.parameters()), learning_rate=0.01)
    before = [_full(p) for p in model.parameters()]
    try:
        opt.minimize(lambda: _loss(model, 0))
    except ValueError as e:
        assert "loss.backward()" in str(e), e
    else:
        raise AssertionError("minimize on FSDP2 parameters did not raise")
    assert all(torch.equal(_full(p), b) for p, b in zip(model.parameters(), before, strict=True))
    # apply_gradients with the gradients backward() left in p.grad is the TF-style path that works.
    _loss(model, 0).backward()
    opt.apply_gradients([(p.grad, p) for p in model.parameters()])
    reference = _model()
    ref_opt = tgo.AdamOptimizer(list(reference.parameters()), learning_rate=0.01)
    _loss(reference, 0).backward()
    ref_opt.apply_gradients([(p.grad, p) for p in reference.parameters()])
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p), r.detach(), rtol=RTOL, atol=ATOL)


CHECKS: dict[str, Callable[[int, int, Path], None]] = {
    "tf_style_under_fsdp2": check_tf_style_under_fsdp2,
    "fsdp2_steps_match_unsharded": check_fsdp2_steps_match_unsharded,
    "dcp_resume_under_fsdp2": check_dcp_resume_under_fsdp2,
    "full_state_dict_resume_under_fsdp2": check_full_state_dict_resume_under_fsdp2,
    "zero_resume": check_zero_resume,
}


def run_checks(rank: int, world: int, port: int, names: list[str], tmp: str, results: Any) -> None:
    """Entry point of a spawned rank: one gloo group on 127.0.0.1, then every named check."""
    init_gloo(rank, world, port)
    try:
        for name in names:
            try:
                CHECKS[name](rank, world, Path(tmp))
                results.put((name, rank, None))
            except Exception:
                results.put((name, rank, traceback.format_exc()))
            dist.barrier()
    finally:
        dist.destroy_process_group()
