"""Time one update of ``train.ExponentialMovingAverage`` beside torch's exponential moving averages.

    python scripts/bench_ema.py --quick
    python scripts/bench_ema.py --workload 10M --repeats 50 --threads 1

Five updates of copies of the same float32 averages towards the same
parameters, at decay 0.999: ours with ``fused=True`` (compiled kernels, one pass
over each average and its parameter; the kernel is compiled before the timing),
``foreach=True`` (the default) and ``foreach=False`` (the reference loop),
``torch.optim.swa_utils.AveragedModel``
with ``get_ema_multi_avg_fn(0.999)`` (``update_parameters``, which lerps its
copy of the parameters towards them with ``torch._foreach_lerp_``), and a bare
``torch._foreach_lerp_`` over the two lists, the least work any exponential
moving average does. Ours rounds TF's way, ``s - (s - v) * (1 - decay)`` in
three operations, where ``lerp`` makes one fused multiply-add: the same
average up to the last bits, in about a third of the arithmetic.

Beside them, in the same repeats, a physical floor: one ``copy_`` over the
bytes one update must move (it reads the averages and the parameters and writes
the averages: 3 × 4 bytes per parameter).

All are timed in turn within each repeat, so that load from other processes
falls on all of them alike; the table gives the median milliseconds per update
after the warm-up updates, the spread (interquartile range / median), and the
ratios ours / torch. ``--clock cpu`` times the process's CPU time instead of
the wall clock: on a machine shared with other work, the time this process
waits for a core is then left out (with several threads, their times add up).
The output is a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import _bench
import torch
from torch import Tensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from torchgrad_compat.train import ExponentialMovingAverage

DECAY = 0.999
# name -> (number of tensors, elements per tensor)
WORKLOADS: dict[str, tuple[int, int]] = {"1M": (100, 10_000), "10M": (1000, 10_000)}
# The target: ours within this factor of AveragedModel's update.
TARGET = 1.0
NAMES = ("ours fused", "ours foreach", "ours loop", "AveragedModel", "_foreach_lerp_", "copy floor")


def make_params(workload: str, seed: int) -> list[Tensor]:
    count, size = WORKLOADS[workload]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=gen) for _ in range(count)]


def updates(params: list[Tensor], fused: bool) -> dict[str, Callable[[], object]]:
    """The timed calls by their NAMES, each over its own averages of ``params``; "ours fused" only
    with ``fused``."""
    named = {f"p{i}": p for i, p in enumerate(params)}
    calls: dict[str, Callable[[], object]] = {}
    if fused:
        fused_ema = ExponentialMovingAverage(DECAY, fused=True)
        fused_ema.apply(named)  # (compiles the kernel, or loads it from Inductor's cache)
        calls["ours fused"] = lambda: fused_ema.apply(params)
    ours = ExponentialMovingAverage(DECAY)
    ours.apply(named)
    loop = ExponentialMovingAverage(DECAY, foreach=False)
    loop.apply(named)
    module = torch.nn.ParameterList([torch.nn.Parameter(p, requires_grad=False) for p in params])
    averaged = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=False)
    averaged.update_parameters(module)  # the first call copies the parameters
    shadows = [p.clone() for p in params]
    src = torch.empty(sum(p.numel() for p in params) * 3 // 2).normal_()
    dst = torch.empty_like(src)
    calls["ours foreach"] = lambda: ours.apply(params)
    calls["ours loop"] = lambda: loop.apply(params)
    calls["AveragedModel"] = lambda: averaged.update_parameters(module)
    calls["_foreach_lerp_"] = lambda: torch._foreach_lerp_(shadows, params, 1 - DECAY)
    calls["copy floor"] = lambda: dst.copy_(src)
    return calls


def format_table(rows: list[tuple[str, dict[str, list[float]]]]) -> str:
    """A row per workload from the times of each call by name; "—" where "ours fused" was not timed."""
    header = ["workload", *(f"{n} (spread)" for n in NAMES), "ours fused / AveragedModel"]
    header += ["ours foreach / AveragedModel", "ours fused / _foreach_lerp_", "floor % of ours fused"]
    lines = []
    for workload, times in rows:
        medians = {name: statistics.median(t) for name, t in times.items()}
        cells = [f"{medians[n]:.2f} ({_bench.spread(times[n]):.0%})" if n in times else "—" for n in NAMES]
        fused = medians.get("ours fused")
        foreach, averaged = medians["ours foreach"], medians["AveragedModel"]
        lerp, floor = medians["_foreach_lerp_"], medians["copy floor"]
        ratios = [
            "—" if ours is None else _bench.ratio_cell(ours, averaged, TARGET) for ours in (fused, foreach)
        ]
        ratios += ["—", "—"] if fused is None else [f"{fused / lerp:.2f}x", f"{floor / fused:.0%}"]
        lines.append([workload, *cells, *ratios])
    return _bench.markdown_table(header, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    _bench.add_timing_args(parser, "updates of each")
    parser.add_argument(
        "--no-fused", action="store_true", help="leave out ours fused (its first update compiles a kernel)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _bench.check_timing_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _bench.set_threads(args)
    rows = []
    for workload in args.workload:
        params = make_params(workload, args.seed)
        calls = updates(params, fused=not args.no_fused)
        times = _bench.time_calls(list(calls.values()), args.warmup, args.repeats, _bench.CLOCKS[args.clock])
        rows.append((workload, dict(zip(calls, times.samples, strict=True))))
    count_size = ", ".join(
        f"{w}: {c} tensors of {s:,}" for w, (c, s) in WORKLOADS.items() if w in args.workload
    )
    print(
        f"\nfloat32 on the CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, decay "
        f"{DECAY} ({count_size}): median ms ({args.clock} clock) per update over "
        f" {args.repeats} updates after "
        f"{args.warmup} warm-up updates. Floor: one copy_ of the bytes one update moves; bold: "
        f"ours above {TARGET}x AveragedModel's.\n"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
