"""Every rank decides the same: LossScaleOptimizer in real gloo processes on 127.0.0.1.

Two processes start once (a module fixture) and run every scenario below in one
process group; each rank saves what it saw after every step (its flattened
parameters, the scale, the good-step counter, global_step) and the tests compare
the ranks here. A non-finite gradient appears on rank 1 only, at chosen steps:

- as a rank-local inf written into a gradient after any reduction (plain data
  parallelism without DDP, DDP after its all-reduce, also around torch's fused
  Adam, which skips in its kernel, CrossShardOptimizer after its backward-time
  reduction, and TF style before ``apply_gradients``): only the found-inf
  all-reduce of LossScaleOptimizer can make rank 0 skip too;
- as a NaN loss on rank 1 (DDP and CrossShardOptimizer): the reduction spreads
  it, and every rank must still take the same decision.

Every rank must skip those steps (parameters bitwise unchanged), back off
identically, and keep bitwise equal parameters. DDP around this package's Adam
runs both with ``foreach=False`` and with ``fused=True``, and the two must agree
at tests/optim/test_fused.py's tolerance.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _deadlines import scaled
from _fused_engine import use_small_chunks
from _procs import free_port, init_gloo
from torch import Tensor, nn
from torch.nn import functional as F

import torchgrad_compat.optim as tgo
from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer

WORLD = 2
STEPS = 6
# step (0-based) -> how rank 1 goes non-finite: "grad" (a local inf after any reduction) or "loss" (NaN loss).
FAULTS = {1: "grad", 3: "loss", 4: "grad"}
SKIPPED = sorted(FAULTS)
# The expected scale after every step: 8, period 2; finite steps 0, 2, 5.
SCALES = [8.0, 4.0, 4.0, 2.0, 1.0, 1.0]
# A hung collective fails the run here instead of stalling it (gloo's own timeout is 30 s, scaled).
DEADLINE_S = 90


def _has_cross_shard() -> bool:
    try:
        from torchgrad_compat.xla import CrossShardOptimizer  # noqa: F401
    except ImportError:
        return False
    return True


SCENARIOS = ["tf_style", "torch_style", "ddp", "ddp_fused", "ddp_ours_loop", "ddp_ours_fused"] + (
    ["cross_shard", "cross_shard_tf_style"] if _has_cross_shard() else []
)


# ---------------------------------------------------------------------- rank side
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)


def _loss(model: nn.Module, step: int, rank: int, data_rank: int) -> Tensor:
    x, y = _batch(step, data_rank)
    loss = F.mse_loss(model(x), y)
    return loss * math.nan if rank == 1 and FAULTS.get(step) == "loss" else loss


def _poison_grads(params: list[Tensor], step: int, rank: int) -> None:
    if rank == 1 and FAULTS.get(step) == "grad":
        params[-1].grad[0] = math.inf


def _poison_pairs(pairs: list[tuple[Tensor, Tensor]], step: int, rank: int) -> None:
    if rank == 1 and FAULTS.get(step) == "grad":
        pairs[-1][0][0] = math.inf


def _record(opt: LossScaleOptimizer, params: list[Tensor], global_step: Tensor | None) -> dict[str, Any]:
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in params]).clone(),
        "scale": float(opt.loss_scale()),
        "good_steps": int(opt.loss_scale.good_steps),
        "global_step": None if global_step is None else int(global_step),
    }


def _new_optimizer(inner: torch.optim.Optimizer) -> LossScaleOptimizer:
    return LossScaleOptimizer(inner, DynamicLossScale(initial_loss_scale=8.0, increment_period=2))


def _tf_style(rank: int) -> list[dict[str, Any]]:
    """Same data on every rank, no gradient reduction: TF style, the inf is rank 1's alone."""
    model = _model()
    params = list(model.parameters())
    opt = _new_optimizer(tgo.AdamOptimizer(params, 0.01))
    global_step = torch.zeros((), dtype=torch.int64)
    out = []
    for step in range(STEPS):
        pairs = opt.compute_gradients(_loss(model, step, rank, data_rank=0))
        _poison_pairs(pairs, step, rank)
        opt.apply_gradients(pairs, global_step=global_step)
        out.append(_record(opt, params, global_step))
    return out


def _torch_style(rank: int) -> list[dict[str, Any]]:
    """Same data on every rank, no gradient reduction: torch style, the inf is rank 1's alone."""
    model = _model()
    params = list(model.parameters())
    opt = _new_optimizer(torch.optim.Adam(params, 0.01))
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        opt.get_scaled_loss(_loss(model, step, rank, data_rank=0)).backward()
        _poison_grads(params, step, rank)
        opt.step()
        out.append(_record(opt, params, None))
    return out


def _ddp(rank: int, torch_fused: bool = False, **path: bool) -> list[dict[str, Any]]:
    """DDP around this package's Adam (``path``: its foreach or fused flag), or torch's fused Adam.

    Torch's fused Adam skips in its kernel, on device.
    """
    model = nn.parallel.DistributedDataParallel(_model())
    params = list(model.parameters())
    opt = _new_optimizer(
        torch.optim.Adam(params, 0.01, fused=True) if torch_fused else tgo.AdamOptimizer(params, 0.01, **path)
    )
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        opt.get_scaled_loss(_loss(model, step, rank, data_rank=rank)).backward()
        _poison_grads(params, step, rank)
        opt.step()
        out.append(_record(opt, params, None))
    return out


def _cross_shard(rank: int) -> list[dict[str, Any]]:
    from torchgrad_compat.xla import CrossShardOptimizer

    model = _model()
    params = list(model.parameters())
    opt = _new_optimizer(CrossShardOptimizer(tgo.AdamOptimizer(params, 0.01)))
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        opt.get_scaled_loss(_loss(model, step, rank, data_rank=rank)).backward()
        _poison_grads(params, step, rank)
        opt.step()
        out.append(_record(opt, params, None))
    return out


def _cross_shard_tf_style(rank: int) -> list[dict[str, Any]]:
    from torchgrad_compat.xla import CrossShardOptimizer

    model = _model()
    params = list(model.parameters())
    opt = _new_optimizer(CrossShardOptimizer(tgo.AdamOptimizer(params, 0.01)))
    global_step = torch.zeros((), dtype=torch.int64)
    out = []
    for step in range(STEPS):
        pairs = opt.compute_gradients(_loss(model, step, rank, data_rank=rank))
        _poison_pairs(pairs, step, rank)
        opt.apply_gradients(pairs, global_step=global_step)
        out.append(_record(opt, params, global_step))
    return out


RUNS: dict[str, Callable[[int], list[dict[str, Any]]]] = {
    "tf_style": _tf_style,
    "torch_style": _torch_style,
    "ddp": _ddp,
    "ddp_fused": lambda rank: _ddp(rank, torch_fused=True),
    "ddp_ours_loop": lambda rank: _ddp(rank, foreach=False),
    "ddp_ours_fused": lambda rank: _ddp(rank, fused=True),
    "cross_shard": _cross_shard,
    "cross_shard_tf_style": _cross_shard_tf_style,
}


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """Entry point of a spawned rank: one gloo group, every scenario, results saved per rank."""
    # Fused kernels over chunks of 4 tensors, as in tests/optim/test_fused.py: quick to compile.
    use_small_chunks()
    init_gloo(rank, WORLD, port)
    results: dict[str, Any] = {}
    try:
        for name in SCENARIOS:
            try:
                results[name] = RUNS[name](rank)
            except Exception:
                results[name] = traceback.format_exc()
                break  # the other rank may now be stuck in a collective: stop here
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    # Leave without finalising the interpreter: under torch 2.13 a spawned gloo process that
    # ran backward with collectives sometimes aborts in its teardown, after all of the above
    # ("terminate called without an active exception"; DDP alone: 7 of 25 runs, plain gloo
    # all_reduce: 0 of 30), which would fail this test for a reason outside the code tested.
    os._exit(0)


# ---------------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("amp_distributed")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=run_rank, args=(rank, port, str(out_dir)), daemon=True) for rank in range(WORLD)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + scaled(DEADLINE_S)
    try:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=scaled(5))
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {scaled(DEADLINE_S):.0f} s (a hung collective?)")
    for rank, p in enumerate(procs):
        assert p.exitcode == 0, f"rank {rank} exited with {p.exitcode}"
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rank_skips_and_backs_off_together(ranks: list[dict[str, Any]], scenario: str) -> None:
    runs = [results.get(scenario, "not run") for results in ranks]
    for rank, run in enumerate(runs):
        assert not isinstance(run, str), f"rank {rank} failed:\n{run}"
    for rank, run in enumerate(runs):
        assert [r["scale"] for r in run] == SCALES, f"rank {rank}"
        for step in SKIPPED:
            assert torch.equal(run[step]["params"], run[step - 1]["params"]), (
                f"rank {rank} moved at step {step}"
            )
        for step in set(range(1, STEPS)) - set(SKIPPED):
            assert not torch.equal(run[step]["params"], run[step - 1]["params"]), f"rank {rank} step {step}"
    for step in range(STEPS):
        for key in ("scale", "good_steps", "global_step"):
            assert runs[0][step][key] == runs[1][step][key], f"{key} differs at step {step}"
        assert torch.equal(runs[0][step]["params"], runs[1][step]["params"]), (
            f"parameters differ at step {step}"
        )
    if runs[0][0]["global_step"] is not None:
        assert [r["global_step"] for r in runs[0]] == [1, 1, 2, 2, 2, 3]


def test_ddp_around_our_fused_adam_steps_as_the_loop(ranks: list[dict[str, Any]]) -> None:
    """fused=True under DDP and loss scaling: every step as foreach=False, bitwise."""
    for rank, results in enumerate(ranks):
        fused, loop = results["ddp_ours_fused"], results["ddp_ours_loop"]
        assert not isinstance(fused, str) and not isinstance(loop, str), f"rank {rank} failed"
        for step, (f, r) in enumerate(zip(fused, loop, strict=True)):
            assert f["scale"] == r["scale"], f"rank {rank} step {step}"
            assert torch.equal(f["params"], r["params"]), f"rank {rank} step {step}"


def test_cross_shard_scenarios_run_when_available() -> None:
    """The CrossShardOptimizer scenarios are part of the run whenever torchgrad_compat.xla has it."""
    assert ("cross_shard" in SCENARIOS) == _has_cross_shard()
