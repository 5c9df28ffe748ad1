"""Time ``train.clip_by_global_norm_`` beside ``torch.nn.utils.clip_grad_norm_(foreach=True)``.

    python scripts/bench_clip.py --quick
    python scripts/bench_clip.py --workload 10M --repeats 50 --threads 1

Both clip the ``.grad`` of the same float32 parameters in place (their own copies
of the same gradients), at ``clip_norm`` 1.0. Ours computes TensorFlow's global
norm in the order of TF's CPU kernels (Eigen's), which torch does not: the
gradients are copied piece by piece (about 1 MB) into a workspace that stays in
the cache, squared from there into block-major buffers, and numpy adds those
buffers' rows, each lane's blocks one after another for all leaves at once.
The copy reads the gradients once, as torch's ``_foreach_norm`` does; the
squares and the additions are two more passes, over data in the cache. The
breakdown columns time our norm alone (``train.global_norm``) and torch's
(``torch.nn.utils.get_total_norm``).

Beside them, in the same repeats, a physical floor: one ``copy_`` over as many
bytes as clipping must move (the gradients read for the norm, then read and
written by the scaling: 3 × 4 bytes per parameter). All are timed in turn
within each repeat, so that load from other processes falls on all alike; the
table gives the median milliseconds after the warm-up calls and the spread
(interquartile range / median). The output is a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from torchgrad_compat import train

# name -> (number of tensors, elements per tensor)
WORKLOADS: dict[str, tuple[int, int]] = {"1M": (100, 10_000), "10M": (1000, 10_000)}
# The target: ours within this factor of torch's clip_grad_norm_(foreach=True).
TARGET = 1.1
CLIP_NORM = 1.0


def make_params(workload: str, seed: int) -> list[Tensor]:
    count, size = WORKLOADS[workload]
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(count):
        p = torch.zeros(size, requires_grad=True)
        p.grad = torch.randn(size, generator=gen)
        params.append(p)
    return params


def copies(params: list[Tensor]) -> list[Tensor]:
    out = []
    for p in params:
        q = p.detach().clone().requires_grad_()
        q.grad = p.grad.clone()
        out.append(q)
    return out


def time_calls(calls: list[Callable[[], object]], warmup: int, repeats: int) -> list[list[float]]:
    """Milliseconds of each call of each ``calls[i]`` after ``warmup``, calling them in turn every repeat."""
    times: list[list[float]] = [[] for _ in calls]
    for repeat in range(warmup + repeats):
        for call, samples in zip(calls, times, strict=True):
            start = time.perf_counter()
            call()
            elapsed = (time.perf_counter() - start) * 1e3
            if repeat >= warmup:
                samples.append(elapsed)
    return times


def spread(samples: list[float]) -> float:
    """Interquartile range over the median."""
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / statistics.median(samples)


def bench(workload: str, args: argparse.Namespace) -> str:
    params = make_params(workload, args.seed)
    ours_params, torch_params = copies(params), copies(params)
    ours_grads = [p.grad for p in ours_params]
    torch_grads = [p.grad for p in torch_params]
    numel = sum(p.numel() for p in params)
    src = torch.empty(numel * 3 // 2).normal_()
    dst = torch.empty_like(src)
    calls = [
        lambda: train.clip_by_global_norm_(ours_params, CLIP_NORM),
        lambda: torch.nn.utils.clip_grad_norm_(torch_params, CLIP_NORM, foreach=True),
        lambda: train.global_norm(ours_grads),
        lambda: torch.nn.utils.get_total_norm(torch_grads, foreach=True),
        lambda: dst.copy_(src),
    ]
    times = time_calls(calls, args.warmup, args.repeats)
    ours, theirs, ours_norm, their_norm, floor = (statistics.median(t) for t in times)
    ratio = ours / theirs
    mark = f"**{ratio:.2f}x**" if ratio > TARGET else f"{ratio:.2f}x"
    count, size = WORKLOADS[workload]
    return (
        f"| {workload} ({count} x {size:,}) | {ours:.2f} ({spread(times[0]):.0%}) "
        f"| {theirs:.2f} ({spread(times[1]):.0%}) | {mark} | {ours_norm:.2f} | {their_norm:.2f} "
        f"| {ours_norm / their_norm:.2f}x | {floor:.2f} | {floor / min(ours, theirs):.0%} |"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=30, help="timed calls of each")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    parser.add_argument("--quick", action="store_true", help="3 warm-up and 10 timed calls")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.repeats = 3, 10
    if args.repeats < 2 or args.warmup < 0:
        parser.error(f"--repeats must be >= 2 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"\nfloat32 gradients on the CPU ({torch.get_num_threads()} threads), torch {torch.__version__}: "
        f"median ms per call over {args.repeats} calls after {args.warmup} warm-up calls (spread: "
        f"interquartile range / median). Ratio = ours / torch; bold: above {TARGET}x. Floor: one "
        "copy_ of the bytes clipping moves; floor %: floor / the faster clip.\n"
    )
    print(
        "| workload | ours clip_by_global_norm_ (spread) | torch clip_grad_norm_ foreach (spread) | ratio "
        "| ours global_norm | torch get_total_norm | norm ratio | copy floor | floor % |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for workload in args.workload:
        print(bench(workload, args))


if __name__ == "__main__":
    main()
