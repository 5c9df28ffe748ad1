"""Time what loss scaling adds to an optimizer step: LossScaleOptimizer beside torch.amp.GradScaler.

    python scripts/bench_amp.py --quick
    python scripts/bench_amp.py --workload 10M --repeats 30
    python scripts/bench_amp.py --workload 10M-1000 --inner 'AdamOptimizer (ours, fused)' 'torch Adam (fused)'
    python scripts/bench_amp.py --device cuda --workload 100M

For every inner optimizer four copies of the same parameters take steps, each
with its own copy of the same gradients:

- bare: ``opt.step()`` on the gradients;
- LossScaleOptimizer: ``LossScaleOptimizer(opt, "dynamic").step()`` on the
  gradients times ``2**15`` (unscale in place with the fused check, update the
  scale on device, one host sync, the inner step; around torch's fused Adam no
  host sync: its kernel takes the non-finite flag and skips on device);
- LossScaleOptimizer, fixed: ``LossScaleOptimizer(opt, 2**15).step()`` on the
  same scaled gradients (no check; around this package's fused optimizers on the
  CPU their kernels unscale in their own pass, elsewhere torch's unscale kernel);
- GradScaler: ``scaler.step(opt); scaler.update()`` on the same scaled
  gradients (``torch.amp.GradScaler(init_scale=2**15)``).

Unscaling rewrites the gradients, so they are restored before every step,
outside the timed region (with, for LossScaleOptimizer, the backward pass
through ``get_scaled_loss`` that its ``step()`` requires). The three are timed in turn within each repeat, in
an order that rotates from one repeat to the next, so that load from other
processes falls on all of them alike; the table gives the median milliseconds
per step and the overhead over the bare step. The output is a Markdown table.

``--checks`` times the gradient pass alone instead, each variant over the same
gradients after a pass over four times their bytes (so that they come from
memory, as after a backward pass of a large model, not from cache):

- torch's check-and-unscale in place (what LossScaleOptimizer runs; reads and
  writes each gradient);
- a check that only reads: ``sum(g - g)`` over each gradient, which is NaN
  exactly when some element is NaN or infinite, compiled by Inductor into
  this package's fused kernels (16 gradients a call). ``g * 0`` would not do:
  Inductor folds it to zero;
- the floor of a read: one ``sum`` over a flat tensor of the same size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from torchgrad_compat.amp import LossScaleOptimizer
from torchgrad_compat.optim.adam import AdamOptimizer
from torchgrad_compat.optim.wrapper import fused_update

SCALE = 2.0**15
# name -> (number of tensors, elements per tensor)
WORKLOADS: dict[str, tuple[int, int]] = {
    "1M": (100, 10_000),
    "10M": (200, 50_000),
    "10M-1000": (1000, 10_000),
    "100M": (200, 500_000),
}
# LossScaleOptimizer overheads above this fraction of the bare step are marked in bold.
TARGET = 0.10

# An inner optimizer: a factory over (params, device).
Factory = Callable[[list[Tensor]], torch.optim.Optimizer]
INNER: dict[str, Factory] = {
    "AdamOptimizer (ours, foreach)": lambda ps: AdamOptimizer(ps, foreach=True),
    "AdamOptimizer (ours, fused)": lambda ps: AdamOptimizer(ps, fused=True),
    "torch Adam (foreach)": lambda ps: torch.optim.Adam(ps, foreach=True),
    "torch Adam (fused)": lambda ps: torch.optim.Adam(ps, fused=True),
    "torch SGD (foreach)": lambda ps: torch.optim.SGD(ps, lr=0.01, foreach=True),
}


@dataclass
class Row:
    inner: str
    bare: float
    loss_scale_optimizer: float
    fixed: float
    grad_scaler: float


class Runner:
    """One optimizer over its own parameter copies, with the gradients restored before each step."""

    def __init__(self, params: list[Tensor], grads: list[Tensor], factory: Factory, scaling: str):
        self.params = [p.clone().requires_grad_() for p in params]
        scale = 1.0 if scaling == "bare" else SCALE
        self.loss_scaled = scaling.startswith("loss_scale_optimizer")
        self.saved = [g * scale for g in grads]
        for p, g in zip(self.params, self.saved):
            p.grad = g.clone()
        inner = factory(self.params)
        self.scaler = None
        if self.loss_scaled:
            loss_scale = SCALE if scaling.endswith("fixed") else "dynamic"
            self.opt: torch.optim.Optimizer = LossScaleOptimizer(inner, loss_scale)
        else:
            self.opt = inner
            if scaling == "grad_scaler":
                self.scaler = torch.amp.GradScaler(params[0].device.type, init_scale=SCALE)
                # GradScaler creates its scale in the first scale(loss); the gradients here are given.
                self.scaler.scale(torch.ones((), device=params[0].device))

    def restore(self) -> None:
        if isinstance(self.opt, LossScaleOptimizer):
            # step() needs a backward pass through get_scaled_loss since the last step; this one
            # reaches no parameter, so the gradients are the copies below.
            device = self.params[0].device
            self.opt.get_scaled_loss(torch.zeros((), device=device, requires_grad=True)).backward()
        torch._foreach_copy_([p.grad for p in self.params], self.saved)

    def step(self) -> None:
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()


def make_tensors(workload: str, device: torch.device, seed: int) -> tuple[list[Tensor], list[Tensor]]:
    count, size = WORKLOADS[workload]
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(size, generator=gen).to(device) for _ in range(count)]
    grads = [torch.randn(size, generator=gen).mul_(1e-3).to(device) for _ in range(count)]
    return params, grads


def time_steps(runners: list[Runner], warmup: int, repeats: int, device: torch.device) -> list[float]:
    """Median ms per step of each runner, stepping them in turn in every repeat.

    The order rotates from one repeat to the next: the runner that goes first
    after another's step measurably pays for it on a loaded CPU.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: list[list[float]] = [[] for _ in runners]
    for repeat in range(warmup + repeats):
        for i in range(len(runners)):
            runner, samples = runners[(i + repeat) % len(runners)], times[(i + repeat) % len(runners)]
            runner.restore()
            sync()
            start = time.perf_counter()
            runner.step()
            sync()
            if repeat >= warmup:
                samples.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(samples) for samples in times]


def bench(name: str, params: list[Tensor], grads: list[Tensor], args: argparse.Namespace) -> Row:
    factory = INNER[name]
    runners = [
        Runner(params, grads, factory, scaling)
        for scaling in ("bare", "loss_scale_optimizer", "loss_scale_optimizer_fixed", "grad_scaler")
    ]
    return Row(name, *time_steps(runners, args.warmup, args.repeats, args.device))


def format_table(rows: list[Row]) -> str:
    def overhead(t: float, bare: float, flag: bool) -> str:
        text = f"{(t / bare - 1) * 100:+.1f}%"
        return f"**{text}**" if flag and t / bare - 1 > TARGET else text

    lines = [
        "| inner optimizer | bare step | LossScaleOptimizer | overhead | LossScaleOptimizer, fixed "
        "| overhead | GradScaler | overhead |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.inner} | {r.bare:.2f} | {r.loss_scale_optimizer:.2f} "
            f"| {overhead(r.loss_scale_optimizer, r.bare, flag=True)} | {r.fixed:.2f} "
            f"| {overhead(r.fixed, r.bare, flag=True)} | {r.grad_scaler:.2f} "
            f"| {overhead(r.grad_scaler, r.bare, flag=False)} |"
        )
    return "\n".join(lines)


def _non_finite_sum(params: list[Tensor], grads: list[Tensor], *, total: Tensor) -> None:
    """A read-only check as a fused rule: ``total`` becomes NaN iff some gradient element is not finite."""
    for g in grads:
        total.add_((g - g).sum())


def time_checks(grads: list[Tensor], args: argparse.Namespace) -> list[tuple[str, float]]:
    """Median ms of each gradient pass, the variants in turn, each after a pass over other memory."""
    device = grads[0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    numel = sum(g.numel() for g in grads)
    flat = torch.randn(numel, device=device)
    other = torch.randn(4 * numel, device=device)
    # An unscale by 1 writes each gradient as any other does, and leaves it as it was for the next pass.
    found, inv_scale = torch.zeros(1, device=device), torch.ones((), device=device)
    total = torch.zeros((), device=device)

    def read_only() -> None:
        total.zero_()
        with torch.no_grad():
            fused_update(_non_finite_sum, grads, grads, total=total)

    variants: list[tuple[str, Callable[[], object]]] = [
        (
            "torch check-and-unscale, in place (reads and writes)",
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale),
        ),
        ("read-only check, compiled by Inductor (reads)", read_only),
        ("floor: one sum over a flat tensor of the same bytes (reads)", flat.sum),
    ]
    # Compile, and make sure the compiled check sees an infinity (Inductor must not simplify it away).
    probe = grads[len(grads) // 2].view(-1)
    kept = probe[1].clone()
    probe[1] = float("inf")
    read_only()
    probe[1] = kept
    if not torch.isnan(total):
        raise RuntimeError(f"the compiled read-only check missed an infinity (sum {float(total)})")
    times: list[list[float]] = [[] for _ in variants]
    for repeat in range(args.warmup + args.repeats):
        for i, (_, run) in enumerate(variants):
            other.mul_(1.0)
            sync()
            start = time.perf_counter()
            run()
            sync()
            if repeat >= args.warmup:
                times[i].append((time.perf_counter() - start) * 1e3)
    return [(name, statistics.median(t)) for (name, _), t in zip(variants, times, strict=True)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner", nargs="+", choices=list(INNER), default=list(INNER))
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=["10M"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="1M parameters, 3 warm-up and 10 timed steps")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checks", action="store_true", help="time the non-finite checks alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.repeats, args.workload = 3, 10, ["1M"]
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was requested but torch.cuda.is_available() is False")
    args.device = torch.device(args.device)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    where = (
        torch.cuda.get_device_name() if args.device.type == "cuda" else f"{torch.get_num_threads()} threads"
    )
    for workload in args.workload:
        count, size = WORKLOADS[workload]
        params, grads = make_tensors(workload, args.device, args.seed)
        if args.checks:
            print(
                f"\n{workload} float32 gradients in {count} tensors of {size:,} on {args.device.type} "
                f"({where}), torch {torch.__version__}: median ms per pass over {args.repeats} passes "
                f"after {args.warmup} warm-up passes.\n"
            )
            print("| gradient pass | ms |\n|---|---:|")
            for name, ms in time_checks(grads, args):
                print(f"| {name} | {ms:.2f} |")
            continue
        rows = [bench(name, params, grads, args) for name in args.inner]
        print(
            f"\n{workload} float32 parameters in {count} tensors of {size:,} on {args.device.type} "
            f"({where}), torch {torch.__version__}: median ms per step over {args.repeats} steps "
            f"after {args.warmup} warm-up steps. Overhead = variant / bare - 1; bold: "
            f"LossScaleOptimizer above {TARGET:.0%}.\n"
        )
        print(format_table(rows))


if __name__ == "__main__":
    main()
