"""The benchmark scripts' shared harness: interleaved timing, spread, the common options, tables.

The ``bench_*.py`` scripts import it as a sibling module (``python scripts/bench_x.py``
puts ``scripts/`` first on ``sys.path``). Every script times its candidates in turn
within each repeat, so that load from other processes falls on all of them alike,
and reports the median of the repeats after the warm-up ones with their spread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

# --clock: the wall clock, or the process's CPU time, which leaves out the time this
# process waits for a core on a machine shared with other work (with several threads,
# their times add up).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


class Timings(NamedTuple):
    """Milliseconds of each timed call of each candidate, and of each one's first call."""

    samples: list[list[float]]
    first: list[float]


def time_calls(
    calls: Sequence[Callable[[], object]],
    warmup: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], object] | None = None,
) -> Timings:
    """Call each of ``calls`` in turn, ``warmup + repeats`` times; keep the last ``repeats`` times.

    ``sync`` (``torch.cuda.synchronize``, say) runs before the clock starts and
    before it stops, so that the time of work a call queues on a device is its own.
    """
    samples: list[list[float]] = [[] for _ in calls]
    first: list[float] = []
    for repeat in range(warmup + repeats):
        for call, times in zip(calls, samples, strict=True):
            if sync is not None:
                sync()
            start = clock()
            call()
            if sync is not None:
                sync()
            elapsed = (clock() - start) * 1e3
            if repeat == 0:
                first.append(elapsed)
            if repeat >= warmup:
                times.append(elapsed)
    return Timings(samples, first)


def spread(samples: list[float]) -> float:
    """Interquartile range over the median."""
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / statistics.median(samples)


def ratio_cell(ours: float, theirs: float, target: float | None = None) -> str:
    """``ours / theirs`` as ``1.23x``, in bold above ``target``."""
    text = f"{ours / theirs:.2f}x"
    return f"**{text}**" if target is not None and ours / theirs > target else text


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A Markdown table, its first ``left`` columns aligned left and the others right."""
    rule = "|" + "---|" * left + "---:|" * (len(header) - left)
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def add_timing_args(
    parser: argparse.ArgumentParser,
    unit: str,
    *,
    clock: bool = True,
    threads_help: str = "torch.set_num_threads",
) -> None:
    """``--repeats``, ``--warmup``, ``--quick``, ``--threads`` and (with ``clock``) ``--clock``;
    ``unit`` names what is timed in the help (``"calls"``, ``"steps per optimizer"``)."""
    what = unit.split()[0]
    parser.add_argument("--repeats", type=int, default=30, help=f"timed {unit}")
    parser.add_argument("--warmup", type=int, default=5, help=f"untimed {what} first")
    parser.add_argument("--quick", action="store_true", help=f"3 warm-up and 10 timed {what}")
    parser.add_argument("--threads", type=int, default=None, help=threads_help)
    if clock:
        parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="what is timed")


def check_timing_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, min_repeats: int = 2
) -> None:
    """Apply ``--quick`` and refuse values out of range, through ``parser.error``."""
    if args.quick:
        args.warmup, args.repeats = 3, 10
    if args.repeats < min_repeats or args.warmup < 0:
        parser.error(
            f"--repeats must be >= {min_repeats} and --warmup >= 0, got {args.repeats} and {args.warmup}"
        )
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")


def set_threads(args: argparse.Namespace) -> None:
    """``torch.set_num_threads(--threads)`` when given."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
