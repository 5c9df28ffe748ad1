"""Benchmark ``torchgrad_compat.hessians`` against TF's row loop and ``torch.autograd.functional.hessian``.

The function is one tanh layer, ``y = w2 · tanh(W1 x + b1)`` with ``x`` of size
``n`` and a hidden layer of size ``--hidden``; every method computes the
forward pass and the ``n × n`` Hessian of ``y`` with respect to ``x``:

- ``hessians``: this package (first derivative once, then one vmapped backward pass);
- TF loop: what ``tf.hessians`` runs, one backward pass per element of ``x``.
  For ``n > --loop-rows`` only the first ``--loop-rows`` rows are timed and the
  time is extrapolated linearly (marked ``~``): the rows cost the same;
- ``functional``: ``torch.autograd.functional.hessian(f, x)``, its default
  (a row loop too);
- ``functional vec``: the same with ``vectorize=True`` (legacy batching: it
  expands the weight matrix per row, n·hidden·n elements, so both functional
  columns are skipped above ``--functional-max-n``).

Times are medians over ``--repeats`` runs after one warm-up run.

    python scripts/bench_gradients.py                      # CPU
    python scripts/bench_gradients.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from torchgrad_compat.gradients import hessians


def _layer(n: int, hidden: int, dtype: torch.dtype, device: str) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    g = torch.Generator().manual_seed(n)
    w1 = (torch.randn(hidden, n, generator=g, dtype=dtype) / n**0.5).to(device)
    b1 = torch.randn(hidden, generator=g, dtype=dtype).to(device)
    w2 = torch.randn(hidden, generator=g, dtype=dtype).to(device)
    x = torch.randn(n, generator=g, dtype=dtype).to(device)

    def f(t: Tensor) -> Tensor:
        return w2 @ torch.tanh(w1 @ t + b1)

    return f, x


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_ms(run: Callable[[], object], repeats: int, device: str) -> float:
    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _ours(f: Callable[[Tensor], Tensor], x0: Tensor) -> Tensor:
    x = x0.detach().requires_grad_()
    return hessians(f(x), x, create_graph=False)[0]


def _first_derivative(f: Callable[[Tensor], Tensor], x0: Tensor) -> tuple[Tensor, Tensor]:
    x = x0.detach().requires_grad_()
    (grad,) = torch.autograd.grad(f(x), x, create_graph=True)
    return x, grad


def _tf_loop(f: Callable[[Tensor], Tensor], x0: Tensor, rows: int) -> Tensor:
    """``tf.hessians``' algorithm: the gradient once, then one backward pass per element (first ``rows``)."""
    x, grad = _first_derivative(f, x0)
    return torch.stack([torch.autograd.grad(grad[j], x, retain_graph=True)[0] for j in range(rows)])


def _cell(ms: float | None, ours: float, approx: bool = False) -> str:
    """A time and how many times slower than ``hessians`` it is."""
    if ms is None:
        return "skipped"
    return f"{'~' if approx else ''}{ms:.1f} ms ({ms / ours:.1f}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-rows", type=int, default=256, help="rows of the TF loop timed at most")
    parser.add_argument("--functional-max-n", type=int, default=1024, help="largest n for functional.hessian")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = args.device
    where = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"torch {torch.__version__}, {where}, {args.dtype}, hidden={args.hidden}, median of {args.repeats}")
    print()
    print("| n | hessians | TF loop | functional.hessian | functional vec | max abs diff |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        f, x = _layer(n, args.hidden, dtype, device)
        ours = _median_ms(lambda f=f, x=x: _ours(f, x), args.repeats, device)
        rows = min(n, args.loop_rows)
        loop = _median_ms(lambda f=f, x=x, rows=rows: _tf_loop(f, x, rows), args.repeats, device)
        if rows < n:
            # Only the rows are extrapolated, not the forward and first-derivative pass.
            first = _median_ms(lambda f=f, x=x: _first_derivative(f, x), args.repeats, device)
            loop = first + (loop - first) * n / rows
        functional = vec = None
        if n <= args.functional_max_n:
            functional = _median_ms(
                lambda f=f, x=x: torch.autograd.functional.hessian(f, x), args.repeats, device
            )
            vec = _median_ms(
                lambda f=f, x=x: torch.autograd.functional.hessian(f, x, vectorize=True), args.repeats, device
            )
        # Correctness against TF's algorithm on the rows that were timed.
        diff = (_ours(f, x)[:rows] - _tf_loop(f, x, rows)).abs().max().item()
        print(
            f"| {n} | {ours:.1f} ms | {_cell(loop, ours, approx=rows < n)} | "
            f"{_cell(functional, ours)} | {_cell(vec, ours)} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
