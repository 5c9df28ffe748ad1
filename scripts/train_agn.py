"""Asynchronous training with AGN: one parameter server and any number of workers, over torch RPC.

    torchrun --nproc-per-node 3 scripts/train_agn.py                  # ps + 2 workers, Adam, period 4
    torchrun --nproc-per-node 5 scripts/train_agn.py --period 16 --optimizer momentum
    torchrun --nproc-per-node 3 scripts/train_agn.py --checkpoint /tmp/ps.pt --checkpoint-every 10
    torchrun --nproc-per-node 3 scripts/train_agn.py --restore /tmp/ps.pt   # continue from it
    AGN_TOKEN=$(openssl rand -hex 16) torchrun --nproc-per-node 3 scripts/train_agn.py --transport grpc

Rank 0 runs :func:`run_parameter_server`; every other rank is a worker that
trains on its own shard of a synthetic classification task (16 features, 4
classes decided by a fixed random linear "teacher"; nothing is downloaded).
The server prints the accuracy of the center parameters on held-out data
before and after.

RPC listens on ``MASTER_ADDR`` only (torchrun's default: 127.0.0.1). torch RPC
has no authentication: run it on a trusted network only. ``--transport grpc``
uses gRPC instead (``pip install grpcio``): the server listens on
``MASTER_ADDR:--grpc-port`` and every request must carry the shared token in
``AGN_TOKEN``.

Every wait is bounded: the rendezvous and the first contact with the server
(``--startup-timeout``), each request (``--rpc-timeout``). A worker that dies
is noticed by the server, which serves the others to the end; every process
then leaves without waiting for the dead one (``rpc.shutdown(graceful=False)``,
once the server has answered every worker's ``finish()``). A server that is
torn down (torchrun sends SIGTERM when a process of the job fails) writes its
``--checkpoint`` first.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn
from torch.nn import functional as F

from torchgrad_compat.agn import AGNOptimizer, init_rpc_from_env, run_parameter_server
from torchgrad_compat.optim import AdamOptimizer, GradientDescentOptimizer, MomentumOptimizer

FEATURES, CLASSES = 16, 4
OPTIMIZERS = {
    "adam": lambda params, lr: AdamOptimizer(params, learning_rate=lr),
    "momentum": lambda params, lr: MomentumOptimizer(params, learning_rate=lr, momentum=0.9),
    "sgd": lambda params, lr: GradientDescentOptimizer(params, learning_rate=lr),
}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def make_data(seed: int, n: int) -> tuple[Tensor, Tensor]:
    """``n`` examples labelled by the teacher (the same teacher for every seed)."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(dim=1)


def accuracy(model: nn.Module, data: tuple[Tensor, Tensor]) -> float:
    with torch.no_grad():
        x, y = data
        return (model(x).argmax(dim=1) == y).float().mean().item()


def serve(args: argparse.Namespace, num_worker: int, transport: Any = None) -> None:
    model = make_model(args.seed)
    held_out = make_data(10_000, 2_000)
    start_from = (
        f"restored from {args.restore}"
        if args.restore
        else f"center accuracy before {accuracy(model, held_out):.3f}"
    )
    print(f"ps: serving {num_worker} workers; {start_from}", flush=True)
    start = time.perf_counter()
    center = run_parameter_server(
        list(model.parameters()),
        lambda params: OPTIMIZERS[args.optimizer](params, args.lr),
        num_worker,
        checkpoint_path=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        restore_from=args.restore,
        transport=transport,
        join_timeout=2 * args.startup_timeout,  # a worker that never makes contact is not waited for forever
    )
    with torch.no_grad():
        for p, c in zip(model.parameters(), center, strict=True):
            p.copy_(c)
    print(
        f"ps: all workers done in {time.perf_counter() - start:.1f} s; "
        f"center accuracy after {accuracy(model, held_out):.3f}",
        flush=True,
    )


def work(args: argparse.Namespace, rank: int, num_worker: int, server: Any = "ps") -> None:
    model = make_model(args.seed + rank)  # AGNOptimizer replaces these with the server's parameters
    opt = AGNOptimizer(
        OPTIMIZERS[args.optimizer](list(model.parameters()), args.lr),
        num_worker,
        args.period,
        server=server,
        startup_timeout=args.startup_timeout,
    )
    print(f"worker{rank}: joined at global_step {opt.global_step} (pid {os.getpid()})", flush=True)
    x, y = make_data(rank, args.steps * args.batch)
    for step in range(args.steps):
        rows = slice(step * args.batch, (step + 1) * args.batch)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        if (step + 1) % max(1, args.steps // 4) == 0:
            progress = f"step {step + 1} loss {loss.item():.4f} global_step {opt.global_step}"
            print(f"worker{rank}: {progress}", flush=True)
    opt.finish()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--period", type=int, default=4, help="communication_period")
    parser.add_argument("--steps", type=int, default=200, help="local steps per worker")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rpc-timeout", type=float, default=30.0)
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="rendezvous and first contact")
    parser.add_argument("--checkpoint", default=None, help="server checkpoint file")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="server updates between checkpoints")
    parser.add_argument("--restore", default=None, help="server checkpoint to continue from")
    parser.add_argument("--transport", choices=["rpc", "grpc"], default="rpc")
    parser.add_argument("--grpc-port", type=int, default=29600, help="grpc: the server's port")
    args = parser.parse_args()
    if args.transport == "grpc":
        token = os.environ.get("AGN_TOKEN")
        if not token:
            parser.error("--transport grpc needs the shared secret in the environment variable AGN_TOKEN")
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            parser.error(
                "--transport grpc reads RANK and WORLD_SIZE, which torchrun sets: launch it with "
                "`torchrun --nproc-per-node 3 scripts/train_agn.py --transport grpc`"
            )
        run_over_grpc(args, token)
        return

    name = init_rpc_from_env(rpc_timeout=args.rpc_timeout, startup_timeout=args.startup_timeout)
    info = rpc.get_worker_info()
    num_worker = len(rpc.api._get_current_rpc_agent().get_worker_infos()) - 1
    try:
        if name == "ps":
            serve(args, num_worker)
        else:
            work(args, info.id, num_worker)
    finally:
        # Not graceful: that waits for every process of the group, a killed one too, forever. Nothing is
        # left to exchange: the server has answered each worker's finish() (or found it dead) and lingered.
        rpc.shutdown(graceful=False)


def run_over_grpc(args: argparse.Namespace, token: str) -> None:
    """Rank 0 serves on ``MASTER_ADDR:--grpc-port``; the other ranks reach it with the token."""
    # Imported here: grpcio is an optional dependency, needed by this transport only.
    from torchgrad_compat.agn.grpc_transport import GrpcEndpoint, GrpcServerHost

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{args.grpc_port}"
    if rank == 0:
        serve(args, world_size - 1, transport=GrpcServerHost(address, token))
        return
    endpoint = GrpcEndpoint(address, f"worker{rank}", token, timeout=args.rpc_timeout)
    try:
        work(args, rank, world_size - 1, server=endpoint)
    finally:
        endpoint.close()


if __name__ == "__main__":
    main()
