"""TensorFlow v1's learning-rate decays (``tf.compat.v1.train.*_decay``) with TF's float32 numbers.

Each function takes TF's arguments, names and defaults and returns a
:class:`LearningRateDecay`: a zero-argument callable that reads ``global_step``
and returns the decayed learning rate as a 0-d float32 tensor, as TF 2's eager
``tf.compat.v1.train.exponential_decay(...)`` returns a callable. It is a
``learning_rate`` for this package's optimizers, and :class:`DecayLR` drives
``group["lr"]`` with it as a ``torch.optim.lr_scheduler``.

TF computes a decay afresh at every step from ``global_step`` cast to float32
(the learning rate's dtype), op by op in float32, where torch's schedulers
multiply a Python double from step to step. ``LearningRateDecay.at(step)``
replays TF's ops in TF's order with TF's float32 rounding (see ``_float32``):
the value is TF's bit for bit at any step, including steps past 2**24 where
float32 cannot hold the step exactly.

Eager TF computes a decay as its source writes it; a TF1 graph (``Session``,
Estimator, ``tf.function``) computes it after Grappler's rewrites, which give
other float32 numbers (see ``_graph_decays``): ``graph=True`` gives those.

Differences from TensorFlow:

1. The learning rate is float32: a Python number, or a 0-d float32 tensor read
   at each evaluation. TF also computes in float64 for a float64 learning rate;
   that is not reproduced (a float64 tensor is refused).
2. Bad input is refused when the decay is made, by name (TF computes NaN or
   inf): ``decay_steps <= 0``, a negative or non-finite learning rate or rate,
   boundaries that do not increase, ``alpha`` outside [0, 1].
3. ``noisy_linear_cosine_decay`` draws its noise from torch, not TF's random op
   (see its docstring); its formula is TF's.
4. ``name`` is accepted and unused.
5. ``graph=True`` is a graph whose global step is a variable and whose
   hyperparameters are constants (the learning rate a Python number); a fed
   global step, or a learning rate in a variable, gives other numbers there.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..optim.wrapper import check_range
from . import _float32 as f
from . import _graph_decays as g

# TF's ``constant_op.constant(math.pi)``: float32 whatever the learning rate's dtype.
_PI = f.f32(math.pi)
_STEP_DTYPES = (torch.int32, torch.int64)

Number = int | float


class LearningRateDecay:
    """A decayed learning rate that follows a global step: TF's eager ``*_decay`` callable.

    ``decay()`` reads ``global_step`` (a 0-d int32/int64 tensor, read at each
    call, which waits for an accelerator's pending work; or a Python int) and
    returns TF's float32 learning rate at that step as a 0-d float32 tensor;
    ``decay.at(step)`` returns it as a Python float for any step. The decay
    functions of this module make these; pass one as an optimizer's
    ``learning_rate``, or to :class:`DecayLR`.

    Example:
        >>> import torch
        >>> from torchgrad_compat import optim, train
        >>> global_step = torch.zeros((), dtype=torch.int64)
        >>> lr = train.exponential_decay(0.1, global_step, 1000, 0.96, staircase=True)
        >>> w = torch.zeros(3, requires_grad=True)
        >>> opt = optim.GradientDescentOptimizer([w], learning_rate=lr)
        >>> opt.minimize(lambda: (w - 1).square().sum(), global_step=global_step)
        >>> int(global_step), lr.at(2500)
        (1, 0.09216000139713287)
    """

    def __init__(
        self, rule: Callable[[int], float], global_step: Any, name: str, graph: bool = False
    ) -> None:
        self._rule = rule
        self.global_step = global_step
        self.name = name
        self.graph = graph

    def __call__(self) -> Tensor:
        if self.global_step is None:
            raise RuntimeError(
                f"{self.name} was made with global_step=None, so it has no step to read: pass a "
                "0-d integer tensor as global_step, or drive it with DecayLR or .at(step)"
            )
        # (scalar_tensor: torch.tensor's inference from a Python object takes twice as long)
        return torch.scalar_tensor(self.at(int(self.global_step)), dtype=torch.float32)

    def at(self, step: int) -> float:
        """TF's float32 learning rate at ``step`` (an int ≥ 0), as a Python float."""
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"Invalid global_step value: {step!r}; expected a value in [0, inf)")
        return self._rule(step)

    def __repr__(self) -> str:
        mode = ", graph=True" if self.graph else ""
        return f"LearningRateDecay({self.name}, global_step={self.global_step!r}{mode})"


def exponential_decay(
    learning_rate: Number | Tensor,
    global_step: Any,
    decay_steps: Number,
    decay_rate: Number,
    staircase: bool = False,
    name: str | None = None,
    *,
    graph: bool = False,
) -> LearningRateDecay:
    """``learning_rate * decay_rate ** (global_step / decay_steps)``, as TF's ``exponential_decay``.

    With ``staircase=True`` the exponent is ``floor(global_step / decay_steps)``.
    Each operation rounds to float32; ``**`` is the C library's ``powf``.

    Args:
        learning_rate: the initial learning rate, ≥ 0.
        global_step: a 0-d int32/int64 tensor, a Python int, or None (for :class:`DecayLR`).
        decay_steps: > 0.
        decay_rate: ≥ 0.
        staircase: decay at multiples of ``decay_steps`` only.
        name: accepted for TF compatibility, unused.
        graph: keyword-only, not TF's. False (the default): the numbers of eager
            TF, which computes as TF's source writes it. True: the numbers of a
            TF1 graph (``Session``, Estimator, ``tf.function``), which Grappler
            rewrites: ``step / decay_steps`` is ``step * (1 / decay_steps)``,
            constants fold together. The learning rate must then be a Python
            number (a graph constant).

    Raises:
        ValueError: an argument out of range, naming it and the value.
        TypeError: an argument of another type.
    """
    learning_rate = _check_common(learning_rate, global_step, decay_steps, "decay_steps", graph)
    rate = _checked("decay_rate", decay_rate, 0.0)
    _check_bool("staircase", staircase)
    rule = g.exponential if graph else _exponential
    rule = functools.partial(rule, learning_rate, f.f32(decay_steps), f.f32(rate), staircase)
    return LearningRateDecay(rule, global_step, "ExponentialDecay", graph)


def natural_exp_decay(
    learning_rate: Number | Tensor,
    global_step: Any,
    decay_steps: Number,
    decay_rate: Number,
    staircase: bool = False,
    name: str | None = None,
    *,
    graph: bool = False,
) -> LearningRateDecay:
    """``learning_rate * exp(-decay_rate * global_step / decay_steps)``, as TF's ``natural_exp_decay``.

    TF computes it as :func:`exponential_decay` with the rate ``exp(-decay_rate)``
    (in float32), so this does too: ``staircase`` floors the exponent's
    ``global_step / decay_steps``. Arguments as :func:`exponential_decay`.
    """
    learning_rate = _check_common(learning_rate, global_step, decay_steps, "decay_steps", graph)
    rate = _checked("decay_rate", decay_rate, 0.0)
    _check_bool("staircase", staircase)
    natural_rate = f.exp(-f.f32(rate))
    rule = g.exponential if graph else _exponential
    rule = functools.partial(rule, learning_rate, f.f32(decay_steps), natural_rate, staircase)
    return LearningRateDecay(rule, global_step, "NaturalExpDecay", graph)


def _exponential(
    learning_rate: float | Tensor, decay_steps: float, rate: float, staircase: bool, step: int
) -> float:
    p = f.div(f.f32(step), decay_steps)
    if staircase:
        p = f.floor(p)
    return f.mul(_learning_rate(learning_rate), f.pow(rate, p))


def inverse_time_decay(
    learning_rate: Number | Tensor,
    global_step: Any,
    decay_steps: Number,
    decay_rate: Number,
    staircase: bool = False,
    name: str | None = None,
    *,
    graph: bool = False,
) -> LearningRateDecay:
    """``learning_rate / (1 + decay_rate * global_step / decay_steps)``, as TF's ``inverse_time_decay``.

    ``staircase`` floors ``global_step / decay_steps``. Arguments as :func:`exponential_decay`.
    """
    learning_rate = _check_common(learning_rate, global_step, decay_steps, "decay_steps", graph)
    rate = _checked("decay_rate", decay_rate, 0.0)
    _check_bool("staircase", staircase)
    rule = g.inverse_time if graph else _inverse_time
    rule = functools.partial(rule, learning_rate, f.f32(decay_steps), f.f32(rate), staircase)
    return LearningRateDecay(rule, global_step, "InverseTimeDecay", graph)


def _inverse_time(
    learning_rate: float | Tensor, decay_steps: float, rate: float, staircase: bool, step: int
) -> float:
    p = f.div(f.f32(step), decay_steps)
    if staircase:
        p = f.floor(p)
    return f.div(_learning_rate(learning_rate), f.add(1.0, f.mul(rate, p)))


def polynomial_decay(
    learning_rate: Number | Tensor,
    global_step: Any,
    decay_steps: Number,
    end_learning_rate: Number = 0.0001,
    power: Number = 1.0,
    cycle: bool = False,
    name: str | None = None,
    *,
    graph: bool = False,
) -> LearningRateDecay:
    """From ``learning_rate`` to ``end_learning_rate`` in ``decay_steps``, as TF's ``polynomial_decay``.

    With ``s = min(global_step, decay_steps)``::

        (learning_rate - end_learning_rate) * (1 - s / decay_steps) ** power + end_learning_rate

    With ``cycle=True``, ``decay_steps`` becomes ``decay_steps * ceil(global_step /
    decay_steps)`` (1 at step 0) and ``s = global_step``: the decay restarts from
    ``learning_rate`` after each period, over longer periods.

    Args:
        end_learning_rate: ≥ 0.
        power: ≥ 0.
        cycle: restart after ``decay_steps``.
        Others as :func:`exponential_decay`.
    """
    learning_rate = _check_common(learning_rate, global_step, decay_steps, "decay_steps", graph)
    end = _checked("end_learning_rate", end_learning_rate, 0.0)
    power = _checked("power", power, 0.0)
    _check_bool("cycle", cycle)
    rule = g.polynomial if graph else _polynomial
    hypers = f.f32(decay_steps), f.f32(end), f.f32(power), cycle
    rule = functools.partial(rule, learning_rate, *hypers)
    return LearningRateDecay(rule, global_step, "PolynomialDecay", graph)


def _polynomial(
    learning_rate: float | Tensor, decay_steps: float, end: float, power: float, cycle: bool, step: int
) -> float:
    s = f.f32(step)
    if cycle:
        multiplier = 1.0 if s == 0 else f.ceil(f.div(s, decay_steps))
        decay_steps = f.mul(decay_steps, multiplier)
    else:
        s = f.minimum(s, decay_steps)
    p = f.div(s, decay_steps)
    lr = _learning_rate(learning_rate)
    return f.add(f.mul(f.sub(lr, end), f.pow(f.sub(1.0, p), power)), end)


def piecewise_constant(
    x: Any,
    boundaries: Sequence[int],
    values: Sequence[Number | Tensor],
    name: str | None = None,
    *,
    graph: bool = False,
) -> LearningRateDecay:
    """``values[i]`` while ``boundaries[i-1] < x <= boundaries[i]``, as TF's ``piecewise_constant``.

    ``values[0]`` up to and including ``boundaries[0]``, ``values[-1]`` after
    ``boundaries[-1]``; the step ``x`` is compared as an integer.

    Args:
        x: the global step (as ``global_step`` of :func:`exponential_decay`).
        boundaries: strictly increasing ints, at least one.
        values: one more than ``boundaries``: learning rates ≥ 0, Python numbers
            or 0-d float32 tensors (read when the decay is made).
        graph: as :func:`exponential_decay`'s; a graph computes this one as eager TF does.

    Raises:
        ValueError: boundaries not increasing, or not one fewer than values; a value out of range.
        TypeError: a boundary that is not an int, a value that is not a number.
    """
    _check_global_step(x)
    _check_bool("graph", graph)
    boundaries, values = list(boundaries), list(values)
    if len(boundaries) != len(values) - 1:
        raise ValueError(
            f"Invalid boundaries value: {boundaries!r}; expected one fewer than values, which has "
            f"{len(values)} entries"
        )
    if not boundaries:
        raise ValueError("Invalid boundaries value: []; expected at least one boundary")
    for i, b in enumerate(boundaries):
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"boundaries[{i}] must be an int (a step), got {type(b).__name__}: {b!r}")
    for i, (low, high) in enumerate(itertools.pairwise(boundaries)):
        if not low < high:
            raise ValueError(
                f"Invalid boundaries value: {boundaries!r}; expected strictly increasing steps, "
                f"but boundaries[{i + 1}] = {high!r} follows {low!r}"
            )
    rates = tuple(f.f32(_learning_rate_checked(f"values[{i}]", v)) for i, v in enumerate(values))
    rule = functools.partial(_piecewise, tuple(boundaries), rates)
    return LearningRateDecay(rule, x, "PiecewiseConstant", graph)


def _piecewise(boundaries: tuple[int, ...], values: tuple[float, ...], step: int) -> float:
    return values[bisect.bisect_left(boundaries, step)]


def cosine_decay(
    learning_rate: Number | Tensor,
    global_step: Any,
    decay_steps: Number,
    alpha: Number = 0.0,
    name: str | None = None,
    *,
    graph: bool = False,
) -> LearningRateDecay:
    """Half a cosine from ``learning_rate`` to ``alpha * learning_rate``, as TF's ``cosine_decay``.

    With ``s = min(global_step, decay_steps)``::

        learning_rate * ((1 - alpha) * 0.5 * (1 + cos(pi * s / decay_steps)) + alpha)

    where TF takes ``1 - alpha`` in Python (double) before rounding it to float32.

    Args:
        alpha: the final learning rate as a fraction of ``learning_rate``, in [0, 1].
        Others as :func:`exponential_decay`.
    """
    learning_rate = _check_common(learning_rate, global_step, decay_steps, "decay_steps", graph)
    alpha = _checked("alpha", alpha, 0.0, 1.0, high_inclusive=True)
    rule = g.cosine if graph else _cosine
    hypers = f.f32(decay_steps), f.f32(1 - alpha), f.f32(alpha)
    rule = functools.partial(rule, learning_rate, *hypers)
    return LearningRateDecay(rule, global_step, "CosineDecay", graph)


def _cosine(
    learning_rate: float | Tensor, decay_steps: float, one_minus_alpha: float, alpha: float, step: int
) -> float:
    s = f.minimum(f.f32(step), decay_steps)
    cosine = _half_cosine(f.div(s, decay_steps))
    return f.mul(_learning_rate(learning_rate), f.add(f.mul(one_minus_alpha, cosine), alpha))


def _half_cosine(fraction: float) -> float:
    """``0.5 * (1 + cos(pi * fraction))`` in float32."""
    return f.mul(0.5, f.add(1.0, f.cos(f.mul(_PI, fraction))))


def cosine_decay_restarts(
    learning_rate: Number | Tensor,
    global_step: Any,
    first_decay_steps: Number,
    t_mul: Number = 2.0,
    m_mul: Number = 1.0,
    alpha: Number = 0.0,
    name: str | None = None,
    *,
    graph: bool = False,
) -> LearningRateDecay:
    """Cosine decay with warm restarts (SGDR), as TF's ``cosine_decay_restarts``.

    The first period lasts ``first_decay_steps``, each next one ``t_mul`` times
    longer, and starts from ``m_mul`` times the previous period's initial rate.
    With ``i`` the period and ``c`` the fraction of it completed (TF's formula:
    ``i = floor(log(1 - f * (1 - t_mul)) / log(t_mul))`` for ``f = step /
    first_decay_steps``, or ``floor(f)`` when ``t_mul`` is 1)::

        learning_rate * ((1 - alpha) * 0.5 * m_mul**i * (1 + cos(pi * c)) + alpha)

    Args:
        first_decay_steps: > 0.
        t_mul: > 0. Below 1 the periods shrink and their sum is finite: past it,
            TF's formula (and so this) gives NaN.
        m_mul: ≥ 0.
        alpha: in [0, 1].
        Others as :func:`exponential_decay`.
    """
    learning_rate = _check_common(learning_rate, global_step, first_decay_steps, "first_decay_steps", graph)
    t_mul = _checked("t_mul", t_mul, 0.0, low_inclusive=False)
    m_mul = _checked("m_mul", m_mul, 0.0)
    alpha = _checked("alpha", alpha, 0.0, 1.0, high_inclusive=True)
    rule = g.cosine_restarts if graph else _cosine_restarts
    hypers = f.f32(first_decay_steps), f.f32(t_mul), f.f32(m_mul), f.f32(alpha)
    rule = functools.partial(rule, learning_rate, *hypers)
    return LearningRateDecay(rule, global_step, "SGDRDecay", graph)


def _cosine_restarts(
    learning_rate: float | Tensor,
    first_decay_steps: float,
    t_mul: float,
    m_mul: float,
    alpha: float,
    step: int,
) -> float:
    completed = f.div(f.f32(step), first_decay_steps)
    if t_mul == 1.0:
        restart = f.floor(completed)
        completed = f.sub(completed, restart)
    else:
        restart = f.floor(f.div(f.log(f.sub(1.0, f.mul(completed, f.sub(1.0, t_mul)))), f.log(t_mul)))
        sum_r = f.div(f.sub(1.0, f.pow(t_mul, restart)), f.sub(1.0, t_mul))
        completed = f.div(f.sub(completed, sum_r), f.pow(t_mul, restart))
    # TF writes 0.5 * m_fac * (1 + cos(...)): the product of the first two is rounded first.
    cosine = f.mul(f.mul(0.5, f.pow(m_mul, restart)), f.add(1.0, f.cos(f.mul(_PI, completed))))
    decayed = f.add(f.mul(f.sub(1.0, alpha), cosine), alpha)
    return f.mul(_learning_rate(learning_rate), decayed)


def linear_cosine_decay(
    learning_rate: Number | Tensor,
    global_step: Any,
    decay_steps: Number,
    num_periods: Number = 0.5,
    alpha: Number = 0.0,
    beta: Number = 0.001,
    name: str | None = None,
    *,
    graph: bool = False,
) -> LearningRateDecay:
    """A linear decay times a cosine, as TF's ``linear_cosine_decay``.

    With ``s = min(global_step, decay_steps)``::

        linear = (decay_steps - s) / decay_steps
        cosine = 0.5 * (1 + cos(pi * 2 * num_periods * s / decay_steps))
        learning_rate * ((alpha + linear) * cosine + beta)

    Args:
        num_periods: ≥ 0, the cosine's periods over ``decay_steps``.
        alpha: in [0, 1].
        beta: ≥ 0.
        Others as :func:`exponential_decay`.
    """
    learning_rate = _check_common(learning_rate, global_step, decay_steps, "decay_steps", graph)
    hypers = _linear_cosine_hypers(num_periods, alpha, beta)
    if graph:
        rule = functools.partial(g.linear_cosine, learning_rate, f.f32(decay_steps), *hypers, None)
    else:
        rule = functools.partial(_linear_cosine, learning_rate, f.f32(decay_steps), *hypers)
    return LearningRateDecay(rule, global_step, "LinearCosineDecay", graph)


def _linear_cosine_hypers(num_periods: Number, alpha: Number, beta: Number) -> tuple[float, float, float]:
    """``2 * num_periods``, ``alpha`` and ``beta`` in float32, checked."""
    num_periods = _checked("num_periods", num_periods, 0.0)
    alpha = _checked("alpha", alpha, 0.0, 1.0, high_inclusive=True)
    beta = _checked("beta", beta, 0.0)
    return f.mul(2.0, f.f32(num_periods)), f.f32(alpha), f.f32(beta)


def _linear_cosine(
    learning_rate: float | Tensor,
    decay_steps: float,
    two_periods: float,
    alpha: float,
    beta: float,
    step: int,
) -> float:
    s = f.minimum(f.f32(step), decay_steps)
    linear = f.div(f.sub(decay_steps, s), decay_steps)
    cosine = _half_cosine(f.mul(two_periods, f.div(s, decay_steps)))
    return f.mul(_learning_rate(learning_rate), f.add(f.mul(f.add(alpha, linear), cosine), beta))


def noisy_linear_cosine_decay(
    learning_rate: Number | Tensor,
    global_step: Any,
    decay_steps: Number,
    initial_variance: Number = 1.0,
    variance_decay: Number = 0.55,
    num_periods: Number = 0.5,
    alpha: Number = 0.0,
    beta: Number = 0.001,
    name: str | None = None,
    *,
    seed: int | None = None,
    graph: bool = False,
) -> LearningRateDecay:
    """:func:`linear_cosine_decay` with Gaussian noise added to its linear part, as TF's.

    With ``s = min(global_step, decay_steps)``, the linear part becomes
    ``linear + z * sqrt(initial_variance / (1 + s) ** variance_decay)`` with
    ``z`` a standard normal float32 draw; the rest is :func:`linear_cosine_decay`.

    The noise: TF draws ``z`` from its random op (its global and op seeds), which
    torch cannot reproduce, so ``z`` comes from torch: with ``seed=None`` (the
    default, as TF's unseeded op) each evaluation draws ``torch.randn`` from
    torch's default generator (``torch.manual_seed`` fixes the sequence); with
    an int ``seed`` (keyword-only, not TF's), ``z`` at step ``k`` is drawn from a
    generator seeded with a hash of ``(seed, k)``: a function of the step, the
    same however often and in whatever order it is evaluated, so that a
    :class:`DecayLR` resumes from its ``state_dict`` with the same values. Given
    the same ``z``, the value is TF's bit for bit.

    With TF's default ``initial_variance=1.0`` the noise is as large as the
    linear part, so the learning rate is often negative, which TF applies and
    this package's optimizers refuse (``ValueError`` naming ``learning_rate``).

    Args:
        initial_variance: ≥ 0.
        variance_decay: ≥ 0.
        seed: None, or an int ≥ 0 that makes the noise a function of the step.
        Others as :func:`linear_cosine_decay`.
    """
    learning_rate = _check_common(learning_rate, global_step, decay_steps, "decay_steps", graph)
    variance = _checked("initial_variance", initial_variance, 0.0)
    variance_decay = _checked("variance_decay", variance_decay, 0.0)
    hypers = _linear_cosine_hypers(num_periods, alpha, beta)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be None or an int, got {type(seed).__name__}: {seed!r}")
        check_range("seed", seed, 0)
    rule = functools.partial(
        _graph_noisy_linear_cosine if graph else _noisy_linear_cosine,
        learning_rate,
        f.f32(decay_steps),
        f.f32(variance),
        f.f32(variance_decay),
        *hypers,
        seed,
    )
    return LearningRateDecay(rule, global_step, "NoisyLinearCosineDecay", graph)


def _noisy_linear_cosine(
    learning_rate: float | Tensor,
    decay_steps: float,
    initial_variance: float,
    variance_decay: float,
    two_periods: float,
    alpha: float,
    beta: float,
    seed: int | None,
    step: int,
) -> float:
    s = f.minimum(f.f32(step), decay_steps)
    linear = f.div(f.sub(decay_steps, s), decay_steps)
    std = f.sqrt(f.div(initial_variance, f.pow(f.add(1.0, s), variance_decay)))
    # TF's random_normal: rnd * stddev + mean, with mean 0.
    noisy = f.add(linear, f.add(f.mul(_standard_normal(seed, step), std), 0.0))
    cosine = _half_cosine(f.mul(two_periods, f.div(s, decay_steps)))
    return f.mul(_learning_rate(learning_rate), f.add(f.mul(f.add(alpha, noisy), cosine), beta))


def _graph_noisy_linear_cosine(
    learning_rate: float,
    decay_steps: float,
    initial_variance: float,
    variance_decay: float,
    two_periods: float,
    alpha: float,
    beta: float,
    seed: int | None,
    step: int,
) -> float:
    noise = (initial_variance, variance_decay, _standard_normal(seed, step))
    return g.linear_cosine(learning_rate, decay_steps, two_periods, alpha, beta, noise, step)


def _standard_normal(seed: int | None, step: int) -> float:
    """A float32 standard normal draw: torch's default generator, or one seeded by ``(seed, step)``."""
    if seed is None:
        return torch.randn((), dtype=torch.float32).item()
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randn((), dtype=torch.float32, generator=generator).item()


def linear_warmup(
    learning_rate: Number | Tensor, decayed: LearningRateDecay, num_warmup_steps: int
) -> LearningRateDecay:
    """A linear warm-up from 0 to ``learning_rate`` in ``num_warmup_steps``, then ``decayed``.

    BERT's form (``optimization.create_optimizer``)::

        if global_step < num_warmup_steps:   # compared as integers
            learning_rate * (float32(global_step) / float32(num_warmup_steps))
        else:
            decayed

    in float32, at ``decayed``'s global step. BERT blends the two with
    ``(1 - is_warmup) * decayed + is_warmup * warmup``, which is the same number
    for a finite ``decayed``. The warm-up computes as ``decayed`` does: with
    ``graph=True`` there, as a TF1 graph, ``global_step * (learning_rate *
    (1 / num_warmup_steps))``.

    Example (BERT: a linear decay to 0 over the whole run, warm-up first):
        >>> import torch
        >>> from torchgrad_compat import train
        >>> global_step = torch.zeros((), dtype=torch.int64)
        >>> decayed = train.polynomial_decay(5e-5, global_step, 10000, end_learning_rate=0.0)
        >>> lr = train.linear_warmup(5e-5, decayed, 1000)
        >>> lr.at(0), lr.at(1000) == decayed.at(1000)
        (0.0, True)

    Raises:
        ValueError: ``learning_rate`` < 0 or ``num_warmup_steps`` < 1.
        TypeError: ``decayed`` is not a :class:`LearningRateDecay`; ``learning_rate``
            is a tensor and ``decayed`` computes as a graph.
    """
    if not isinstance(decayed, LearningRateDecay):
        raise TypeError(
            f"decayed must be a LearningRateDecay (from a decay function), got {type(decayed).__name__}"
        )
    _learning_rate_checked("learning_rate", learning_rate, decayed.graph)
    learning_rate = _rounded(learning_rate)
    if isinstance(num_warmup_steps, bool) or not isinstance(num_warmup_steps, int):
        raise TypeError(
            f"num_warmup_steps must be an int, got {type(num_warmup_steps).__name__}: {num_warmup_steps!r}"
        )
    check_range("num_warmup_steps", num_warmup_steps, 1)
    rule = functools.partial(_warmup, learning_rate, f.f32(num_warmup_steps), num_warmup_steps, decayed)
    return LearningRateDecay(rule, decayed.global_step, f"LinearWarmup({decayed.name})", decayed.graph)


def _warmup(
    learning_rate: float | Tensor,
    warmup_steps: float,
    num_warmup_steps: int,
    decayed: LearningRateDecay,
    step: int,
) -> float:
    if step >= num_warmup_steps:
        return decayed.at(step)
    if decayed.graph:
        return g.warmup(learning_rate, warmup_steps, step)
    return f.mul(_learning_rate(learning_rate), f.div(f.f32(step), warmup_steps))


def _rounded(value: Number | Tensor) -> float | Tensor:
    """A learning rate as a decay keeps it: a number rounded to float32 once, a tensor as it is."""
    return value if isinstance(value, Tensor) else f.f32(float(value))


def _learning_rate(value: float | Tensor) -> float:
    """The learning rate in float32; a tensor is read now (TF reads it at every evaluation)."""
    return f.f32(float(value)) if isinstance(value, Tensor) else value


def _check_common(
    learning_rate: Any, global_step: Any, decay_steps: Any, steps_arg: str, graph: Any
) -> float | Tensor:
    """Check the arguments every decay takes; return the learning rate as the decay keeps it."""
    _check_bool("graph", graph)
    _learning_rate_checked("learning_rate", learning_rate, graph)
    _check_global_step(global_step)
    _checked(steps_arg, decay_steps, 0.0, low_inclusive=False)
    return _rounded(learning_rate)


def _learning_rate_checked(arg: str, value: Any, graph: bool = False) -> float:
    """A learning rate: a Python number or a 0-d float32 tensor, finite and ≥ 0 in float32; only a
    number with ``graph`` (a graph's constant, which Grappler folds into others)."""
    if isinstance(value, Tensor) and graph:
        raise TypeError(
            f"{arg} must be a Python number with graph=True (the graph's constant, which Grappler folds "
            f"into the decay's other constants); got a tensor: use its value, or graph=False"
        )
    if isinstance(value, Tensor):
        if value.dtype != torch.float32 or value.dim() != 0:
            raise TypeError(
                f"{arg} given as a tensor must be 0-d float32 (TF's decays are reproduced in float32), "
                f"got {value.dim()}-d {value.dtype}"
            )
        return _checked(arg, float(value), 0.0)
    return _checked(arg, value, 0.0)


def _checked(
    arg: str,
    value: Any,
    low: float,
    high: float = math.inf,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = False,
) -> float:
    """``value``, a Python number, in range as given and once rounded to float32, where TF computes
    with it (``1e-50`` for a ``decay_steps`` > 0 is 0 there, ``1e39`` is inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg} must be a Python number, got {type(value).__name__}: {value!r}")
    bounds = {"low_inclusive": low_inclusive, "high_inclusive": high_inclusive}
    check_range(arg, value, low, high, **bounds)
    try:
        rounded = f.f32(float(value))
    except OverflowError:
        raise ValueError(
            f"Invalid {arg} value: an int of {value.bit_length()} bits, too large for a float"
        ) from None
    above = low <= rounded if low_inclusive else low < rounded
    below = rounded <= high if high_inclusive else rounded < high
    if not (above and below):
        interval = f"{'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"
        raise ValueError(
            f"Invalid {arg} value: {value!r}; expected a value in {interval} once rounded to float32, "
            f"where TF computes (it rounds to {rounded!r})"
        )
    return value


def _check_bool(arg: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {type(value).__name__}: {value!r}")


def _check_global_step(global_step: Any) -> None:
    """None, a Python int ≥ 0, or a 0-d int32/int64 tensor (TF's global step)."""
    if global_step is None:
        return
    if isinstance(global_step, Tensor):
        if global_step.dim() != 0 or global_step.dtype not in _STEP_DTYPES:
            raise TypeError(
                f"global_step given as a tensor must be 0-d int32 or int64, got "
                f"{global_step.dim()}-d {global_step.dtype}"
            )
        return
    if isinstance(global_step, bool) or not isinstance(global_step, int):
        raise TypeError(
            "global_step must be a 0-d integer tensor, an int or None, got "
            f"{type(global_step).__name__}: {global_step!r}"
        )
    check_range("global_step", global_step, 0)
