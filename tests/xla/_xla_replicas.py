"""Several torch_xla replicas on the CPU, one thread each, for tests/xla/test_xla_replicas.py.

torch_xla 2.9 has no multi-process collectives on the CPU, but with
``CPU_NUM_DEVICES=N`` ``xmp.spawn`` runs one thread per CPU device in one
process, and XLA:CPU's collectives meet across those threads. Three measures
make that work; without any one of them the replicas never meet and XLA aborts
the process after 10 s ("only 1 of them arrived"):

1. One compile per graph. XLA:CPU's collective rendezvous is keyed on the
   compiled module, and two threads compiling the same graph at the same time
   get two modules that never meet. A round-robin turnstile around
   ``torch_xla.sync`` lets replica 0 compile a step's graph first; the others
   find it in the compilation cache.
2. ``gc.collect()`` before each sync, so that tensors a replica no longer uses
   are gone on every replica alike and every replica traces the same graph.
3. Collectives whose program does not depend on the replica: the library
   gathers with ``pin_layout=False`` (the pinned all_gather pads by ordinal),
   and data that differs by replica reaches the device as data, never as a
   constant in the graph. ``XLA_THREAD_POOL_SIZE`` is at least the number of
   replicas, so that every replica's execution can wait at a collective at once.

Run as ``python tests/xla/_xla_replicas.py --replicas N --out DIR``: every scenario
of ``SCENARIOS`` runs on every replica, each writing its parameters (and loss
scale) after every step to ``DIR/<scenario>-<ordinal>.pt``. The test compares
them with one CPU process on the full batch. With ``--spmd``, one SPMD program
runs over a mesh of N devices instead (no threads, no turnstile).
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from _deadlines import scaled
from torch import Tensor

STEPS = 4
LOCAL_BATCH = 4
# The step at which the last replica's batch holds an inf, in the loss-scaling scenarios.
INF_STEP = 1
# How long a replica waits for its turn at a sync before the harness gives up (XLA itself aborts a
# collective that not every replica reaches after 10 s).
TURN_TIMEOUT_S = scaled(120.0)


@dataclass(frozen=True)
class Scenario:
    style: str  # "tf": minimize; "torch": backward + step
    reduction: str  # "mean" or "sum"
    groups: tuple[tuple[int, ...], ...] | None = None
    loss_scale: bool = False  # a LossScaleOptimizer around the CrossShardOptimizer, an inf on one replica
    min_replicas: int = 2

    @property
    def name(self) -> str:
        parts = [self.style, self.reduction]
        if self.groups:
            parts.append("groups")
        if self.loss_scale:
            parts.append("lossscale")
        return "-".join(parts)


SCENARIOS = [
    Scenario("tf", "mean"),
    Scenario("tf", "sum"),
    Scenario("torch", "mean"),
    Scenario("torch", "sum"),
    Scenario("tf", "mean", groups=((0, 1), (2, 3)), min_replicas=4),
    Scenario("tf", "sum", groups=((0, 1), (2, 3)), min_replicas=4),
    Scenario("torch", "mean", groups=((0, 1), (2, 3)), min_replicas=4),
    Scenario("torch", "sum", groups=((0, 1), (2, 3)), min_replicas=4),
    Scenario("tf", "mean", loss_scale=True),
    Scenario("torch", "mean", loss_scale=True),
    Scenario("torch", "sum", loss_scale=True),
]


def initial_params() -> list[Tensor]:
    """A two-layer MLP's weights (row-major ``x @ w``), the same on every replica and in the reference."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=gen) * 0.5,
        torch.randn(5, generator=gen) * 0.1,
        torch.randn(5, 1, generator=gen) * 0.5,
    ]


def batches(world: int, loss_scale: bool) -> list[tuple[Tensor, Tensor]]:
    """The global batch of every step: ``world * LOCAL_BATCH`` rows, replica ``r`` taking slice ``r``."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        x = torch.randn(world * LOCAL_BATCH, 3, generator=gen)
        y = torch.randn(world * LOCAL_BATCH, 1, generator=gen)
        if loss_scale and step == INF_STEP:
            x[-1, 0] = float("inf")
        out.append((x, y))
    return out


def loss_of(params: list[Tensor], x: Tensor, y: Tensor) -> Tensor:
    w1, b1, w2 = params
    return (torch.tanh(x @ w1 + b1) @ w2 - y).pow(2).mean()


def shard(batch: tuple[Tensor, Tensor], replica: int) -> tuple[Tensor, Tensor]:
    rows = slice(replica * LOCAL_BATCH, (replica + 1) * LOCAL_BATCH)
    return batch[0][rows], batch[1][rows]


def make_optimizer(params: list[Tensor], scenario: Scenario, *, cross_shard: bool) -> torch.optim.Optimizer:
    """Adam (TF's), inside a CrossShardOptimizer (``cross_shard``), inside a LossScaleOptimizer."""
    from torchgrad_compat.amp import DynamicLossScale, LossScaleOptimizer
    from torchgrad_compat.optim import AdamOptimizer

    opt: torch.optim.Optimizer = AdamOptimizer(params, learning_rate=0.05)
    if cross_shard:
        from torchgrad_compat.xla import CrossShardOptimizer

        groups = [list(g) for g in scenario.groups] if scenario.groups else None
        opt = CrossShardOptimizer(opt, reduction=scenario.reduction, group_assignment=groups)
    if scenario.loss_scale:
        opt = LossScaleOptimizer(opt, DynamicLossScale(initial_loss_scale=2.0**8, increment_period=2))
    return opt


# ---------------------------------------------------------------------------------- the replicas
class _Turnstile:
    """Lets the replicas through ``torch_xla.sync`` one at a time, in ordinal order, round after round."""

    def __init__(self, replicas: int, sync):
        self._replicas = replicas
        self._sync = sync
        self._turn = 0
        self._cv = threading.Condition()

    def __call__(self, *args, **kwargs) -> None:
        import torch_xla.runtime as xr

        me = xr.global_ordinal()
        gc.collect()
        with self._cv:
            if not self._cv.wait_for(lambda: self._turn == me, timeout=TURN_TIMEOUT_S):
                raise RuntimeError(
                    f"replica {me} waited {TURN_TIMEOUT_S:.0f} s for its turn at torch_xla.sync"
                )
            try:
                self._sync(*args, **kwargs)
            finally:
                self._turn = (self._turn + 1) % self._replicas
                self._cv.notify_all()


def _replica(index: int, out: str) -> None:
    import torch_xla
    import torch_xla.runtime as xr

    me, world = xr.global_ordinal(), xr.world_size()
    device = torch_xla.device()
    for scenario in SCENARIOS:
        if world < scenario.min_replicas:
            continue
        params = [p.to(device).requires_grad_() for p in initial_params()]
        opt = make_optimizer(params, scenario, cross_shard=True)
        record: dict[str, list[Tensor]] = {"params": [], "scale": []}
        for batch in batches(world, scenario.loss_scale):
            x, y = (t.to(device) for t in shard(batch, me))
            if scenario.style == "tf":
                opt.minimize(lambda p=params, x=x, y=y: loss_of(p, x, y))
            else:
                loss = loss_of(params, x, y)
                (opt.get_scaled_loss(loss) if scenario.loss_scale else loss).backward()
                opt.step()
                opt.zero_grad()
            torch_xla.sync()
            record["params"].append(torch.cat([p.detach().cpu().reshape(-1) for p in params]))
            if scenario.loss_scale:
                record["scale"].append(opt.loss_scale().detach().cpu().reshape(()))
        torch.save(record, Path(out) / f"{scenario.name}-{me}.pt")


def _spmd(devices: int, out: str) -> None:
    """TF-style "mean" steps under SPMD: one program, the batch sharded over a data-parallel mesh.

    Writes the parameters after every step and the warnings the constructor gave to
    ``DIR/spmd.pt``.
    """
    import warnings

    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(devices), (devices, 1), ("data", "model"))
    device = torch_xla.device()
    params = [p.to(device).requires_grad_() for p in initial_params()]
    scenario = Scenario("tf", "mean")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = make_optimizer(params, scenario, cross_shard=True)
    record: dict[str, list] = {"params": [], "warnings": [str(w.message) for w in caught]}
    for x, y in batches(devices, loss_scale=False):
        x, y = x.to(device), y.to(device)
        xs.mark_sharding(x, mesh, ("data", None))
        xs.mark_sharding(y, mesh, ("data", None))
        opt.minimize(lambda p=params, x=x, y=y: loss_of(p, x, y))
        torch_xla.sync()
        record["params"].append(torch.cat([p.detach().cpu().reshape(-1) for p in params]))
    torch.save(record, Path(out) / "spmd.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--spmd", action="store_true", help="one SPMD program over a mesh of N devices")
    args = parser.parse_args()
    os.environ.update(
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(args.replicas),
        XLA_THREAD_POOL_SIZE=str(max(8, 2 * args.replicas)),
    )
    if args.spmd:
        _spmd(args.replicas, args.out)
        return
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp

    torch_xla.sync = _Turnstile(args.replicas, torch_xla.sync)
    xmp.spawn(_replica, args=(args.out,), start_method="fork")


if __name__ == "__main__":
    main()
