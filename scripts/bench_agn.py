"""AGN throughput and traffic for 1, 2 and 4 workers × period 1, 4 and 16, beside synchronous training.

    python scripts/bench_agn.py                       # CPU, TensorPipe and gloo on 127.0.0.1
    python scripts/bench_agn.py --workers 1 2 --periods 1 4 --steps 64

Every configuration trains the same MLP (``--width`` hidden units, two hidden
layers) with Adam on random data, ``--batch`` examples per local step and
``--steps`` local steps per worker:

- ``AGN``: one parameter-server process and N worker processes over torch RPC
  (TensorPipe). Bytes are the tensor payload each worker sends (pushes) and
  receives (pulled center), counted by the worker's endpoint, per sample it
  trained on; RPC framing is not included.
- ``sync``: N gloo processes, ``CrossShardOptimizer`` all-reducing gradients at
  every step (what AGN replaces). Bytes are what a ring all-reduce sends per
  worker, ``2 (N - 1) / N`` × the gradient bytes, per sample (computed).

Throughput is all workers' samples divided by the wall time from a barrier
after start-up to the last worker's end. One configuration at a time; the
processes share the machine's cores with each other (and with the server).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn
from torch.nn import functional as F

from torchgrad_compat.agn import AGNOptimizer, RpcEndpoint, run_parameter_server
from torchgrad_compat.optim import AdamOptimizer
from torchgrad_compat.xla import CrossShardOptimizer

LR = 1e-3


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8)
    )


def batches(rank: int, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(batch, 64, generator=gen), torch.randint(8, (batch,), generator=gen))
        for _ in range(steps)
    ]


class CountingEndpoint(RpcEndpoint):
    """An RPC endpoint that counts the tensor bytes it sends and receives."""

    def __init__(self, server: str):
        super().__init__(server)
        self.sent = 0
        self.received = 0

    def request(self, method: str, *args: Any) -> Any:
        answer = super().request(method, *args)
        self.sent += _tensor_bytes(args)
        self.received += _tensor_bytes(answer)
        return answer


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def agn_process(
    rank: int, world: int, port: int, args: argparse.Namespace, start: Any, phase: Any, results: Any
) -> None:
    """Rank 0 serves; the others train. One server per period, one after the other."""
    os.environ["TP_SOCKET_IFNAME"] = "lo"
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
    name = "ps" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    data = batches(rank, args.steps, args.batch)
    for period in args.periods:
        model = make_model(args.width)
        if rank == 0:
            run_parameter_server(list(model.parameters()), lambda ps: AdamOptimizer(ps, LR), world - 1)
        else:
            endpoint = CountingEndpoint("ps")
            opt = AGNOptimizer(
                AdamOptimizer(list(model.parameters()), LR), world - 1, period, server=endpoint
            )
            joined = endpoint.sent + endpoint.received
            start.wait(timeout=120)  # the workers only: timing starts once all have joined
            began = time.time()
            for x, y in data:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            opt.finish()
            traffic = endpoint.sent + endpoint.received - joined
            results.put((period, rank, began, time.time(), traffic))
        phase.wait(timeout=120)  # every worker is done with this period's server
    rpc.shutdown()


def sync_process(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    model = make_model(args.width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: "assuming 1 shard", the intended baseline
        opt = CrossShardOptimizer(AdamOptimizer(list(model.parameters()), LR))
    data = batches(rank + 1, args.steps, args.batch)
    dist.barrier()
    start = time.time()
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    results.put((0, rank, start, time.time(), 0))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(target: Any, world: int, extra: tuple, expected: int) -> list[tuple]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, *extra, results)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        rows = [results.get(timeout=600) for _ in range(expected)]
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--periods", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=192, help="local steps per worker")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    params = sum(p.numel() for p in make_model(args.width).parameters())
    grad_bytes = params * 4
    print(
        f"MLP with {params} float32 parameters ({grad_bytes / 1e6:.2f} MB), Adam, batch {args.batch}, "
        f"{args.steps} steps per worker, {os.cpu_count()} CPU cores, torch {torch.__version__}\n"
    )
    print("| workers | training | period | samples/s | bytes sent + received per sample |")
    print("|---:|---|---:|---:|---:|")
    for n in args.workers:
        ctx = multiprocessing.get_context("spawn")
        rows = _run(agn_process, n + 1, (args, ctx.Barrier(n), ctx.Barrier(n + 1)), n * len(args.periods))
        for period in args.periods:
            mine = [r for r in rows if r[0] == period]
            seconds = max(r[3] for r in mine) - min(r[2] for r in mine)
            samples = n * args.steps * args.batch
            per_sample = sum(r[4] for r in mine) / samples
            print(f"| {n} | AGN | {period} | {samples / seconds:,.0f} | {per_sample:,.0f} |", flush=True)
        rows = _run(sync_process, n, (args,), n)
        seconds = max(r[3] for r in rows) - min(r[2] for r in rows)
        samples = n * args.steps * args.batch
        ring = 2 * (n - 1) / n * grad_bytes / args.batch
        row = f"| {n} | sync (CrossShardOptimizer) | 1 | {samples / seconds:,.0f} | {ring:,.0f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
