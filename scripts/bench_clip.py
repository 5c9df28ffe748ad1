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

import _bench
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


def bench(workload: str, args: argparse.Namespace) -> list[str]:
    """The table's row for ``workload``."""
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
    times = _bench.time_calls(calls, args.warmup, args.repeats).samples
    ours, theirs, ours_norm, their_norm, floor = (statistics.median(t) for t in times)
    count, size = WORKLOADS[workload]
    return [
        f"{workload} ({count} x {size:,})",
        f"{ours:.2f} ({_bench.spread(times[0]):.0%})",
        f"{theirs:.2f} ({_bench.spread(times[1]):.0%})",
        _bench.ratio_cell(ours, theirs, TARGET),
        f"{ours_norm:.2f}",
        f"{their_norm:.2f}",
        _bench.ratio_cell(ours_norm, their_norm),
        f"{floor:.2f}",
        f"{floor / min(ours, theirs):.0%}",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    _bench.add_timing_args(parser, "calls of each", clock=False)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _bench.check_timing_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _bench.set_threads(args)
    print(
        f"\nfloat32 gradients on the CPU ({torch.get_num_threads()} threads), torch {torch.__version__}: "
        f"median ms per call over {args.repeats} calls after {args.warmup} warm-up calls (spread: "
        f"interquartile range / median). Ratio = ours / torch; bold: above {TARGET}x. Floor: one "
        "copy_ of the bytes clipping moves; floor %: floor / the faster clip.\n"
    )
    header = [
        "workload",
        "ours clip_by_global_norm_ (spread)",
        "torch clip_grad_norm_ foreach (spread)",
        "ratio",
        "ours global_norm",
        "torch get_total_norm",
        "norm ratio",
        "copy floor",
        "floor %",
    ]
    print(_bench.markdown_table(header, [bench(workload, args) for workload in args.workload]))


if __name__ == "__main__":
    main()
