"""Time the learning-rate decays of ``torchgrad_compat.train`` beside torch's schedulers.

    python scripts/bench_decay.py --quick
    python scripts/bench_decay.py --repeats 100 --inner 200 --threads 1 --clock cpu

Two tables, from the same run.

The first times a scheduler's ``step()`` alone, in microseconds per call: ``DecayLR``
with TF's exponential, cosine, polynomial and piecewise-constant decays beside the
closest ``torch.optim.lr_scheduler`` (``ExponentialLR``, ``CosineAnnealingLR``,
``PolynomialLR``, ``MultiStepLR``), each over its own one-parameter optimizer of
the same class; beside them the decay evaluated as TF's ``learning_rate``
callable (it reads a global-step tensor and returns a 0-d float32 tensor) and
as ``decay.at(step)`` (the float32 arithmetic alone). Each timed sample is
``--inner`` calls in a row; ``decay_steps`` is large enough that every step lies
inside the decay.

The second times whole training steps over 1M float32 parameters in 100
tensors, with gradients already in place: each optimizer (ours, ``foreach``
path) with a constant learning rate, then with ``DecayLR`` or with torch's
scheduler stepped after it (one decay, ``--train-decay``), and TF's style: the
optimizer's ``learning_rate`` the decay callable or a constant, with the global
step incremented after each step in both. "decay's cost" is the difference of
the medians from the constant-rate row of the same style, which the steps'
own spread swamps; "alone" is the scheduler's or callable's own time from the
first table and "% of step" that time over the constant-rate step.

All candidates of a table are timed in turn within each repeat, so that load
from other processes falls on all of them alike; the tables give the median
after the warm-up repeats and the spread (interquartile range / median).
``--clock cpu`` times the process's CPU time instead of the wall clock. The
output is Markdown.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import _bench
import torch
from torch import Tensor
from torch.optim import lr_scheduler

from torchgrad_compat import optim, train

LR = 0.01
DECAY_STEPS = 1_000_000
BOUNDARIES = [2000, 4000]
TRAIN_WORKLOAD = (100, 10_000)  # tensors, elements per tensor


@dataclass(frozen=True)
class Pair:
    """A TF decay and the torch scheduler closest to it."""

    decay: Callable[[object], train.LearningRateDecay]  # global_step -> decay
    scheduler: str
    torch_scheduler: Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]


PAIRS: dict[str, Pair] = {
    "exponential": Pair(
        lambda step: train.exponential_decay(LR, step, DECAY_STEPS, 0.96),
        "ExponentialLR",
        lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.96 ** (1 / DECAY_STEPS)),
    ),
    "cosine": Pair(
        lambda step: train.cosine_decay(LR, step, DECAY_STEPS),
        "CosineAnnealingLR",
        lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=DECAY_STEPS),
    ),
    "polynomial": Pair(
        lambda step: train.polynomial_decay(LR, step, DECAY_STEPS, end_learning_rate=0.0, power=1.0),
        "PolynomialLR",
        lambda opt: lr_scheduler.PolynomialLR(opt, total_iters=DECAY_STEPS, power=1.0),
    ),
    "piecewise": Pair(
        lambda step: train.piecewise_constant(step, BOUNDARIES, [LR, LR / 10, LR / 100]),
        "MultiStepLR",
        lambda opt: lr_scheduler.MultiStepLR(opt, milestones=BOUNDARIES, gamma=0.1),
    ),
}

# Our optimizers on their foreach path: name -> (params, learning_rate) -> optimizer.
OPTIMIZERS: dict[str, Callable[[list[Tensor], object], torch.optim.Optimizer]] = {
    "AdamOptimizer": lambda ps, lr: optim.AdamOptimizer(ps, learning_rate=lr, foreach=True),
    "GradientDescentOptimizer": lambda ps, lr: optim.GradientDescentOptimizer(
        ps, learning_rate=lr, foreach=True
    ),
}


def repeated(call: Callable[[], object], inner: int) -> Callable[[], None]:
    def calls() -> None:
        for _ in range(inner):
            call()

    return calls


def _one_param_optimizer() -> torch.optim.Optimizer:
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.zeros(1)
    return optim.GradientDescentOptimizer([param], LR)


def scheduler_calls(name: str, inner: int) -> list[Callable[[], None]]:
    """``DecayLR.step``, torch's scheduler's ``step``, the callable and ``at``, each ``inner`` times."""
    pair = PAIRS[name]

    ours = train.DecayLR(_one_param_optimizer(), pair.decay(None))
    theirs = pair.torch_scheduler(_one_param_optimizer())
    for scheduler in (ours, theirs):
        scheduler.optimizer.step()  # (a scheduler stepped before its optimizer warns)
    global_step = torch.tensor(1000, dtype=torch.int64)
    callable_decay = pair.decay(global_step)
    at_decay = pair.decay(None)
    return [
        repeated(ours.step, inner),
        repeated(theirs.step, inner),
        repeated(callable_decay, inner),
        repeated(lambda: at_decay.at(1000), inner),
    ]


def train_steps(optimizer: str, decay: str, seed: int) -> list[Callable[[], None]]:
    """Whole steps of ``optimizer`` over copies of the same parameters and gradients, in the order of
    ``TRAIN_ROWS``."""
    count, size = TRAIN_WORKLOAD
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(size, generator=gen) for _ in range(count)]
    grads = [torch.randn(size, generator=gen).mul_(0.1) for _ in range(count)]
    make = OPTIMIZERS[optimizer]
    pair = PAIRS[decay]

    def fresh(learning_rate: object) -> torch.optim.Optimizer:
        copies = [p.clone().requires_grad_() for p in params]
        for p, g in zip(copies, grads, strict=True):
            p.grad = g
        return make(copies, learning_rate)

    constant = fresh(LR)
    ours = fresh(LR)
    ours_scheduler = train.DecayLR(ours, pair.decay(None))
    theirs = fresh(LR)
    their_scheduler = pair.torch_scheduler(theirs)
    tf_constant, constant_step = fresh(LR), torch.zeros((), dtype=torch.int64)
    global_step = torch.zeros((), dtype=torch.int64)
    tf_decay = fresh(pair.decay(global_step))

    def with_scheduler(opt: torch.optim.Optimizer, scheduler: lr_scheduler.LRScheduler) -> Callable[[], None]:
        def step() -> None:
            opt.step()
            scheduler.step()

        return step

    def tf_style(opt: torch.optim.Optimizer, step_tensor: Tensor) -> Callable[[], None]:
        def step() -> None:
            opt.step()
            step_tensor.add_(1)  # apply_gradients(global_step=...) increments it after the update

        return step

    return [
        constant.step,
        with_scheduler(ours, ours_scheduler),
        with_scheduler(theirs, their_scheduler),
        tf_style(tf_constant, constant_step),
        tf_style(tf_decay, global_step),
    ]


def scheduler_table(names: list[str], args: argparse.Namespace) -> tuple[str, dict[str, list[float]]]:
    """The first table, and each decay's median µs per call: DecayLR, torch's, callable, at."""
    calls = [call for name in names for call in scheduler_calls(name, args.inner)]
    timings = _bench.time_calls(calls, args.warmup, args.repeats, _bench.CLOCKS[args.clock])
    per_call = [[ms * 1e3 / args.inner for ms in samples] for samples in timings.samples]
    rows, medians = [], {}
    for i, name in enumerate(names):
        ours, theirs, callable_decay, at = per_call[4 * i : 4 * i + 4]
        medians[name] = [statistics.median(s) for s in (ours, theirs, callable_decay, at)]
        rows.append(
            [
                name,
                PAIRS[name].scheduler,
                _cell(ours),
                _cell(theirs),
                f"{medians[name][0] - medians[name][1]:+.1f}",
                _bench.ratio_cell(medians[name][0], medians[name][1]),
                _cell(callable_decay),
                _cell(at),
            ]
        )
    header = [
        "decay",
        "torch scheduler",
        "DecayLR.step() µs (spread)",
        "torch step() µs (spread)",
        "DecayLR - torch µs",
        "DecayLR / torch",
        "callable decay() µs (spread)",
        "decay.at(step) µs (spread)",
    ]
    return _bench.markdown_table(header, rows, left=2), medians


TRAIN_ROWS = (
    "constant lr",
    "DecayLR",
    "torch scheduler",
    "constant lr, TF style",
    "decay callable, TF style",
)


def train_table(optimizers: list[str], alone: list[float], args: argparse.Namespace) -> str:
    """The second table; ``alone``: µs per call of DecayLR.step, torch's step and the callable."""
    calls = [call for name in optimizers for call in train_steps(name, args.train_decay, args.seed)]
    timings = _bench.time_calls(calls, args.warmup, args.repeats, _bench.CLOCKS[args.clock])
    per_step = [[ms * 1e3 for ms in samples] for samples in timings.samples]
    rows = []
    n = len(TRAIN_ROWS)
    labels = [
        row if row != "torch scheduler" else f"torch {PAIRS[args.train_decay].scheduler}"
        for row in TRAIN_ROWS
    ]
    for i, name in enumerate(optimizers):
        samples = per_step[n * i : n * i + n]
        medians = [statistics.median(s) for s in samples]
        # Each row's own baseline: the constant-rate step of the same style.
        baselines = [None, medians[0], medians[0], None, medians[3]]
        own = [None, alone[0], alone[1], None, alone[2]]
        for label, times, median, base, cost in zip(labels, samples, medians, baselines, own):
            rows.append(
                [
                    name,
                    label,
                    _cell(times, digits=0),
                    "—" if base is None else f"{median - base:+.0f}",
                    "—" if cost is None else f"{cost:.1f}",
                    "—" if cost is None else f"{cost / base:.2%}",
                ]
            )
    header = [
        "optimizer",
        "learning rate",
        "µs per step (spread)",
        "decay's cost µs",
        "alone µs",
        "% of step",
    ]
    return _bench.markdown_table(header, rows, left=2)


def _cell(samples: list[float], digits: int = 1) -> str:
    return f"{statistics.median(samples):.{digits}f} ({_bench.spread(samples):.0%})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decay", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    parser.add_argument("--optimizer", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS))
    parser.add_argument(
        "--train-decay", choices=list(PAIRS), default="cosine", help="the decay of the training steps"
    )
    parser.add_argument("--inner", type=int, default=100, help="scheduler calls per timed sample")
    _bench.add_timing_args(parser, "repeats of each")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _bench.check_timing_args(parser, args)
    if args.inner < 1:
        parser.error(f"--inner must be >= 1, got {args.inner}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _bench.set_threads(args)
    # The second table's "alone" column is the first table's row of the training steps' decay.
    decays = list(dict.fromkeys([*args.decay, args.train_decay]))
    table, medians = scheduler_table(decays, args)
    steps = train_table(args.optimizer, medians[args.train_decay][:3], args)
    print(
        f"\nOn the CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, {args.clock} clock: "
        f"median over {args.repeats} repeats after {args.warmup} warm-up repeats (spread: "
        "interquartile range / median).\n\n"
        f"A scheduler's step alone, and the decay alone: µs per call, {args.inner} calls per sample; "
        f"one parameter group, decay_steps {DECAY_STEPS:,}.\n"
    )
    print(table)
    count, size = TRAIN_WORKLOAD
    print(
        f"\nA training step over {count * size / 1e6:g}M float32 parameters in {count} tensors "
        f"(foreach path), {args.train_decay} decay: µs per step. Decay's cost: the median's difference "
        "from the constant-rate step of the same style; alone: the scheduler's or callable's own time "
        "(first table); % of step: alone / the constant-rate step.\n"
    )
    print(steps)


if __name__ == "__main__":
    main()
