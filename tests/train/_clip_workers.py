"""The rank side of tests/train/test_clip_distributed.py: clipping across replicas and across shards.

``run_checks`` joins a gloo group on 127.0.0.1, runs the named checks and reports ``(check, rank,
traceback or None)``. Each check compares with a reference computed in the same process from
every rank's data (the ranks' data are made from seeds, so each rank can make all of them).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _procs import init_gloo
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import torchgrad_compat.optim as tgo
from torchgrad_compat import train
from torchgrad_compat.train import sum_of_squares
from torchgrad_compat.xla import CrossShardOptimizer

CLIP_NORM = 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 40), nn.Tanh(), nn.Linear(40, 3))


def _loss(model: nn.Module, rank: int) -> Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    return (model(x) - y).pow(2).sum()


def _rank_grads(world: int) -> list[list[Tensor]]:
    """Every rank's own gradients, computed here for the reference."""
    out = []
    for rank in range(world):
        model = _model()
        _loss(model, rank).backward()
        out.append([p.grad for p in model.parameters()])
    return out


def cross_shard_torch_style(rank: int, world: int) -> None:
    """backward() leaves the cross-replica sum in p.grad: clipping sees it, and every replica clips
    the same gradients the same way (TF code clips after CrossShardOptimizer's sum this way)."""
    model = _model()
    params = list(model.parameters())
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer(params, 0.1), reduction="sum")
    _loss(model, rank).backward()
    norm = train.clip_by_global_norm_(params, CLIP_NORM)
    per_rank = _rank_grads(world)
    summed = [sum(gs[1:], gs[0]) for gs in zip(*per_rank, strict=True)]
    want, want_norm = train.clip_by_global_norm(summed, CLIP_NORM)
    assert torch.equal(norm, want_norm), (norm, want_norm)
    assert want_norm > CLIP_NORM  # the clipping did something
    for p, g in zip(params, want, strict=True):
        assert torch.equal(p.grad, g)
    before = [p.detach().clone() for p in params]
    opt.step()
    for p, b, g in zip(params, before, want, strict=True):
        assert torch.equal(p.detach(), b - 0.1 * g)


def cross_shard_tf_style(rank: int, world: int) -> None:
    """compute_gradients returns each replica's own gradients (TF's CrossShardOptimizer sums in
    apply_gradients): clipped there, each replica clips its own, and apply_gradients sums them."""
    model = _model()
    params = list(model.parameters())
    opt = CrossShardOptimizer(tgo.GradientDescentOptimizer(params, 0.1), reduction="sum")
    grads_and_vars = opt.compute_gradients(_loss(model, rank))
    clipped, _ = train.clip_by_global_norm([g for g, _ in grads_and_vars], CLIP_NORM)
    before = [p.detach().clone() for p in params]
    opt.apply_gradients(zip(clipped, params, strict=True))
    per_rank = [train.clip_by_global_norm(gs, CLIP_NORM)[0] for gs in _rank_grads(world)]
    for p, b, *gs in zip(params, before, *per_rank, strict=True):
        assert torch.equal(p.detach(), b - 0.1 * sum(gs[1:], gs[0]))


def dtensor_global_norm(rank: int, world: int) -> None:
    """A DTensor's norm counts every rank's shard: each shard's sum of squares in Eigen's order, the
    shards' sums all-reduced; every rank gets the same norm, and the clipped tensors keep their
    mesh and placements."""
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(n, 3, generator=gen) * 2 for n in (10, 4000, 7)]
    sharded = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]
    norm = train.global_norm([sharded[0], None, *sharded[1:]])
    shards = [t.tensor_split(world) for t in full]
    squares = torch.stack([sum((sum_of_squares(s) for s in ts[1:]), sum_of_squares(ts[0])) for ts in shards])
    want = train.global_norm([squares.sqrt()])  # sqrt(2 * Eigen's sum of the halves), as TF
    assert torch.equal(norm, want), (norm, want)
    torch.testing.assert_close(norm, train.global_norm(full), rtol=1e-6, atol=0)
    clipped, clipped_norm = train.clip_by_global_norm(sharded, CLIP_NORM)
    assert torch.equal(clipped_norm, norm)
    for c, t in zip(clipped, full, strict=True):
        assert isinstance(c, DTensor) and c.placements == (Shard(0),)
        assert torch.equal(c.full_tensor(), t * (CLIP_NORM / norm))


def fsdp2_in_place(rank: int, world: int) -> None:
    """clip_by_global_norm_ on an FSDP2 model's sharded gradients: the same norm on every rank, the
    whole model's; every shard scaled by it."""
    model = _model()
    reference = _model()
    fully_shard(model)
    _loss(model, 0).backward()
    _loss(reference, 0).backward()
    norm = train.clip_by_global_norm_(model.parameters(), CLIP_NORM)
    norms = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(norms, norm)
    assert all(torch.equal(n, norm) for n in norms), norms
    want_norm = train.global_norm([p.grad for p in reference.parameters()])
    torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert isinstance(p.grad, DTensor)
        assert torch.equal(p.grad.full_tensor(), q.grad * (CLIP_NORM / norm))


CHECKS: dict[str, Callable[[int, int], None]] = {
    "cross_shard_torch_style": cross_shard_torch_style,
    "cross_shard_tf_style": cross_shard_tf_style,
    "dtensor_global_norm": dtensor_global_norm,
    "fsdp2_in_place": fsdp2_in_place,
}


def run_checks(rank: int, world: int, port: int, names: list[str], results: Any) -> None:
    """Entry point of a spawned rank: one gloo group on 127.0.0.1, then every named check."""
    init_gloo(rank, world, port)
    try:
        for name in names:
            try:
                CHECKS[name](rank, world)
                results.put((name, rank, None))
            except Exception:
                results.put((name, rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
