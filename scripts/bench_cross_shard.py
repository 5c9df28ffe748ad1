"""Time one training step: CrossShardOptimizer vs DistributedDataParallel vs a naive per-tensor all-reduce.

    python scripts/bench_cross_shard.py                      # 2 gloo processes on CPU
    python scripts/bench_cross_shard.py --layers 100 --steps 60

Every method trains its own copy of the same model (an MLP of ``--layers``
Linear layers, two tensors each) on the same data with ``torch.optim.SGD``, so
the step differs only in how gradients cross the processes:

- ``DDP``: ``DistributedDataParallel(model)``, ``loss.backward(); opt.step()``;
- ``CrossShardOptimizer, torch style``: ``loss.backward(); opt.step()`` (buckets
  all-reduced during backward);
- ``CrossShardOptimizer, TF style``: ``opt.minimize(loss)`` (``autograd.grad``,
  then the buckets);
- ``naive per-tensor all_reduce``: backward, then one blocking all-reduce per
  gradient tensor;
- ``no communication``: backward and step alone, the floor.

The methods take turns in ``--rounds`` rounds, so that load from other
processes on the machine spreads over all of them. Each step is timed on rank 0
between the ranks' barrier and the end of ``step()``; the table gives the
median and the 10th–90th percentiles over every step, as Markdown.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchgrad_compat.xla import CrossShardOptimizer

LR = 0.01


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


class Method:
    """One way of running a training step; ``step(x, y)`` trains its own copy of the model."""

    def __init__(self, name: str, model: nn.Module, step: Callable[[torch.Tensor, torch.Tensor], None]):
        self.name = name
        self.model = model
        self.step = step
        self.times_ms: list[float] = []


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def build_methods(base: nn.Module, bucket_cap_mb: float) -> list[Method]:
    world = dist.get_world_size()
    methods = []

    ddp = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR)

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        ddp_opt.zero_grad()
        _loss(ddp, x, y).backward()
        ddp_opt.step()

    methods.append(Method("DDP", ddp, ddp_step))

    torch_model = copy.deepcopy(base)
    torch_opt = CrossShardOptimizer(
        torch.optim.SGD(torch_model.parameters(), lr=LR), bucket_cap_mb=bucket_cap_mb
    )

    def cross_shard_torch_step(x: torch.Tensor, y: torch.Tensor) -> None:
        torch_opt.zero_grad()
        _loss(torch_model, x, y).backward()
        torch_opt.step()

    methods.append(Method("CrossShardOptimizer, torch style", torch_model, cross_shard_torch_step))

    tf_model = copy.deepcopy(base)
    tf_opt = CrossShardOptimizer(torch.optim.SGD(tf_model.parameters(), lr=LR), bucket_cap_mb=bucket_cap_mb)

    def cross_shard_tf_step(x: torch.Tensor, y: torch.Tensor) -> None:
        tf_opt.minimize(_loss(tf_model, x, y))

    methods.append(Method("CrossShardOptimizer, TF style (minimize)", tf_model, cross_shard_tf_step))

    naive_model = copy.deepcopy(base)
    naive_opt = torch.optim.SGD(naive_model.parameters(), lr=LR)

    def naive_step(x: torch.Tensor, y: torch.Tensor) -> None:
        naive_opt.zero_grad()
        _loss(naive_model, x, y).backward()
        for p in naive_model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        naive_opt.step()

    methods.append(Method("naive per-tensor all_reduce", naive_model, naive_step))

    local_model = copy.deepcopy(base)
    local_opt = torch.optim.SGD(local_model.parameters(), lr=LR)

    def local_step(x: torch.Tensor, y: torch.Tensor) -> None:
        local_opt.zero_grad()
        _loss(local_model, x, y).backward()
        local_opt.step()

    methods.append(Method("no communication (floor)", local_model, local_step))
    return methods


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )
    base = make_model(args.layers, args.width)
    methods = build_methods(base, args.bucket_cap_mb)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    for method in methods:
        for _ in range(args.warmup):
            method.step(x, y)
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for method in methods:
            for _ in range(per_round):
                dist.barrier()
                start = time.perf_counter()
                method.step(x, y)
                method.times_ms.append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        report(methods, args, world)
    dist.destroy_process_group()


def report(methods: list[Method], args: argparse.Namespace, world: int) -> None:
    model = methods[0].model
    tensors = sum(1 for _ in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    ddp = statistics.median(methods[0].times_ms)
    print(
        f"{world} processes, gloo on 127.0.0.1, CPU, {args.threads} thread(s) each; "
        f"torch {torch.__version__}; "
        f"MLP of {args.layers} Linear({args.width}, {args.width}) = {tensors} tensors, {numel:,} parameters "
        f"({numel * 4 / 2**20:.1f} MiB of float32 gradients); batch {args.batch} per process; "
        f"bucket_cap_mb {args.bucket_cap_mb}; {len(methods[0].times_ms)} timed steps per method "
        f"after {args.warmup} warm-up steps, in {args.rounds} interleaved rounds; rank 0's clock.\n"
    )
    print("| method | median ms/step | p10-p90 ms | vs DDP |")
    print("|---|---:|---:|---:|")
    for method in methods:
        median = statistics.median(method.times_ms)
        spread = f"{_percentile(method.times_ms, 0.1):.2f}-{_percentile(method.times_ms, 0.9):.2f}"
        print(f"| {method.name} | {median:.2f} | {spread} | {median / ddp:.2f}x |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="number of processes")
    parser.add_argument("--layers", type=int, default=50, help="Linear layers (two tensors each)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="examples per process")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = parser.parse_args(argv)
    for name in ("world", "layers", "width", "batch", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
