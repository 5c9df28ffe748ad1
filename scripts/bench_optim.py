"""Time one step of each TF optimizer beside its closest ``torch.optim`` counterpart.

    python scripts/bench_optim.py --quick
    python scripts/bench_optim.py --workload 10M --repeats 50
    python scripts/bench_optim.py --optimizer adam rmsprop --device cuda

For every TF optimizer, four optimizers step copies of the same parameters with
the same gradients: ours with ``foreach=False`` (the reference for-loop) and
``foreach=True``, and its ``torch.optim`` counterpart in both modes. Each runs
at TensorFlow's defaults (learning_rate 0.01 where TF has none; l1 = l2 = 0),
the counterpart at the same values. AdagradDA, Ftrl, ProximalAdagrad and
ProximalGradientDescent have no ``torch.optim`` counterpart: they are set beside
the nearest one in cost (Adagrad or SGD), marked "≈" in the table.

The four are timed in turn within each repeat, so that load from other processes
falls on all of them alike; the table gives the median milliseconds per step
after the warm-up steps, and the ratios ours / torch (loop against loop, foreach
against foreach). The output is a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from torchgrad_compat.optim import (
    AdadeltaOptimizer,
    AdagradDAOptimizer,
    AdagradOptimizer,
    AdamOptimizer,
    FtrlOptimizer,
    GradientDescentOptimizer,
    MomentumOptimizer,
    ProximalAdagradOptimizer,
    ProximalGradientDescentOptimizer,
    RMSPropOptimizer,
)

# A factory takes (params, foreach) and returns an optimizer over them.
Factory = Callable[[list[Tensor], bool], torch.optim.Optimizer]


@dataclass(frozen=True)
class Case:
    """One TF optimizer (``ours``) and the ``torch.optim`` optimizer it is timed against."""

    ours: Factory
    counterpart: str
    theirs: Factory
    # False: torch.optim has no such optimizer and `theirs` is only a yardstick.
    equivalent: bool = True


LR = 0.01
CASES: dict[str, Case] = {
    "gradient_descent": Case(
        lambda ps, fe: GradientDescentOptimizer(ps, LR, foreach=fe),
        "SGD",
        lambda ps, fe: torch.optim.SGD(ps, LR, foreach=fe),
    ),
    "momentum": Case(
        lambda ps, fe: MomentumOptimizer(ps, LR, 0.9, foreach=fe),
        "SGD(momentum=0.9)",
        lambda ps, fe: torch.optim.SGD(ps, LR, momentum=0.9, foreach=fe),
    ),
    "adagrad": Case(
        lambda ps, fe: AdagradOptimizer(ps, LR, foreach=fe),
        "Adagrad",
        lambda ps, fe: torch.optim.Adagrad(ps, LR, initial_accumulator_value=0.1, foreach=fe),
    ),
    "adagrad_da": Case(
        lambda ps, fe: AdagradDAOptimizer(ps, LR, foreach=fe),
        "Adagrad",
        lambda ps, fe: torch.optim.Adagrad(ps, LR, initial_accumulator_value=0.1, foreach=fe),
        equivalent=False,
    ),
    "adam": Case(
        lambda ps, fe: AdamOptimizer(ps, foreach=fe),
        "Adam",
        lambda ps, fe: torch.optim.Adam(ps, foreach=fe),
    ),
    "adadelta": Case(
        lambda ps, fe: AdadeltaOptimizer(ps, foreach=fe),
        "Adadelta",
        lambda ps, fe: torch.optim.Adadelta(ps, lr=0.001, rho=0.95, eps=1e-8, foreach=fe),
    ),
    # TF's RMSProp keeps its momentum buffer even at momentum=0; torch's skips it.
    "rmsprop": Case(
        lambda ps, fe: RMSPropOptimizer(ps, LR, foreach=fe),
        "RMSprop",
        lambda ps, fe: torch.optim.RMSprop(ps, LR, alpha=0.9, eps=1e-10, foreach=fe),
    ),
    "ftrl": Case(
        lambda ps, fe: FtrlOptimizer(ps, LR, foreach=fe),
        "Adagrad",
        lambda ps, fe: torch.optim.Adagrad(ps, LR, initial_accumulator_value=0.1, foreach=fe),
        equivalent=False,
    ),
    "proximal_adagrad": Case(
        lambda ps, fe: ProximalAdagradOptimizer(ps, LR, foreach=fe),
        "Adagrad",
        lambda ps, fe: torch.optim.Adagrad(ps, LR, initial_accumulator_value=0.1, foreach=fe),
        equivalent=False,
    ),
    "proximal_gradient_descent": Case(
        lambda ps, fe: ProximalGradientDescentOptimizer(ps, LR, foreach=fe),
        "SGD",
        lambda ps, fe: torch.optim.SGD(ps, LR, foreach=fe),
        equivalent=False,
    ),
}

# name -> (number of tensors, elements per tensor)
WORKLOADS: dict[str, tuple[int, int]] = {"1M": (100, 10_000), "10M": (1000, 10_000)}
# The target of the issue: each foreach path within this factor of torch's.
TARGET = 1.2


@dataclass
class Row:
    name: str
    counterpart: str
    # Median ms per step: ours loop, ours foreach, torch loop, torch foreach.
    ours_loop: float
    ours_foreach: float
    torch_loop: float
    torch_foreach: float


def make_tensors(workload: str, device: torch.device, seed: int) -> tuple[list[Tensor], list[Tensor]]:
    count, size = WORKLOADS[workload]
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(size, generator=gen).to(device) for _ in range(count)]
    grads = [torch.randn(size, generator=gen).mul_(0.1).to(device) for _ in range(count)]
    return params, grads


def make_optimizer(
    factory: Factory, params: list[Tensor], grads: list[Tensor], foreach: bool
) -> torch.optim.Optimizer:
    """An optimizer over fresh copies of ``params`` whose ``.grad`` are the shared ``grads``."""
    copies = [p.clone().requires_grad_() for p in params]
    for p, g in zip(copies, grads, strict=True):
        p.grad = g
    return factory(copies, foreach)


def time_steps(
    optimizers: list[torch.optim.Optimizer], warmup: int, repeats: int, device: torch.device
) -> list[float]:
    """Median ms per ``step()`` of each optimizer, stepping them in turn in every repeat."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: list[list[float]] = [[] for _ in optimizers]
    for repeat in range(warmup + repeats):
        for opt, samples in zip(optimizers, times, strict=True):
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            if repeat >= warmup:
                samples.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(samples) for samples in times]


def bench(name: str, params: list[Tensor], grads: list[Tensor], args: argparse.Namespace) -> Row:
    case = CASES[name]
    optimizers = [
        make_optimizer(factory, params, grads, foreach)
        for factory in (case.ours, case.theirs)
        for foreach in (False, True)
    ]
    ours_loop, ours_foreach, torch_loop, torch_foreach = time_steps(
        optimizers, args.warmup, args.repeats, args.device
    )
    counterpart = case.counterpart if case.equivalent else f"≈ {case.counterpart}"
    return Row(name, counterpart, ours_loop, ours_foreach, torch_loop, torch_foreach)


def format_table(rows: list[Row]) -> str:
    def ratio(ours: float, theirs: float, flag: bool) -> str:
        text = f"{ours / theirs:.2f}x"
        return f"**{text}**" if flag and ours / theirs > TARGET else text

    lines = [
        "| optimizer | torch.optim | ours loop | torch loop | loop ratio "
        "| ours foreach | torch foreach | foreach ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.counterpart} | {r.ours_loop:.2f} | {r.torch_loop:.2f} "
            f"| {ratio(r.ours_loop, r.torch_loop, flag=False)} | {r.ours_foreach:.2f} "
            f"| {r.torch_foreach:.2f} | {ratio(r.ours_foreach, r.torch_foreach, flag=True)} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="3 warm-up and 10 timed steps")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.repeats = 3, 10
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
        rows = [bench(name, params, grads, args) for name in args.optimizer]
        print(
            f"\n{workload} float32 parameters in {count} tensors of {size:,} on {args.device.type} "
            f"({where}), torch {torch.__version__}: median ms per step over {args.repeats} steps "
            f"after {args.warmup} warm-up steps.\nRatio = ours / torch; bold: foreach ratio above "
            f"{TARGET}x; ≈: torch.optim has no equivalent, the nearest in cost is shown.\n"
        )
        print(format_table(rows))


if __name__ == "__main__":
    main()
