"""The learning-rate decays as a TF1 graph computes them: TF's ops after Grappler's rewrites.

A decay built in a TF1 graph (a ``Session``, an Estimator, a ``tf.function``)
is run by Grappler, TF's graph optimizer, on by default. With the decay's
hyperparameters constants of the graph (Python numbers, ``tf.constant``), its
rewrites change the float32 arithmetic (read from the optimized graphs of TF
2.21, ``RunOptions(output_partition_graphs=True)``):

- a division by a constant becomes a multiplication by its float32 reciprocal:
  ``step / decay_steps`` is ``step * (1 / decay_steps)``, which is not always
  the same float32 number, and at a multiple of ``decay_steps`` can fall just
  below the integer (``41 * (1 / 41)`` < 1), so a staircase's ``floor`` steps
  one global step late;
- constants move through products and fold together (``pi * (s * (1 /
  decay_steps))`` is ``s * (pi * (1 / decay_steps))``, the learning rate joins
  the constant ``0.5`` of a cosine or the reciprocal of a linear part), so
  products round in another order;
- a term that is a constant zero (``alpha``, ``beta``, ``end_learning_rate``)
  is dropped, which lets the learning rate fold further in (where shapes are
  known: with the global step fed through a placeholder Grappler keeps ``x +
  0`` and ``x * 1``, and computes yet other numbers, not reproduced);
- a constant exponent of 2, 3 or 0.5 becomes ``Square``, ``Square`` times the
  base, ``Sqrt``; an exponent of 0 makes the result a constant.

Each function here is the optimized graph's formula for one decay, op for op,
with :mod:`._float32`'s arithmetic; arguments as the eager rules of
``learning_rate_decay`` (hyperparameters already rounded to float32, the
learning rate a Python number).
"""

from __future__ import annotations

import math

from . import _float32 as f

_PI = f.f32(math.pi)


def reciprocal(x: float) -> float:
    """Grappler's folded ``Reciprocal`` of a constant divisor: correctly rounded, as TF's kernel
    computes it for a 0-d tensor (for longer tensors its vectorised path is not, e.g. 1/37)."""
    return f.div(1.0, x)


def exponential(lr: float, decay_steps: float, rate: float, staircase: bool, step: int) -> float:
    p = f.mul(f.f32(step), reciprocal(decay_steps))
    if staircase:
        p = f.floor(p)
    return f.mul(lr, f.pow(rate, p))


def inverse_time(lr: float, decay_steps: float, rate: float, staircase: bool, step: int) -> float:
    p = f.mul(f.f32(step), reciprocal(decay_steps))
    if staircase:
        return f.div(lr, f.add(1.0, f.mul(rate, f.floor(p))))
    # rate * (step * (1/decay_steps)): the constant moves down into the reciprocal.
    return f.div(lr, f.add(1.0, f.mul(f.f32(step), f.mul(rate, reciprocal(decay_steps)))))


def polynomial(lr: float, decay_steps: float, end: float, power: float, cycle: bool, step: int) -> float:
    s = f.f32(step)
    if cycle:
        multiplier = 1.0 if s == 0 else f.ceil(f.mul(s, reciprocal(decay_steps)))
        p = f.div(s, f.mul(decay_steps, multiplier))
    else:
        p = f.mul(f.minimum(s, decay_steps), reciprocal(decay_steps))
    base = f.sub(1.0, p)
    scale = f.sub(lr, end)
    if power == 0.0:
        return f.add(scale, end)
    if power == 1.0:
        powered = f.mul(scale, base)
    elif power == 2.0:
        powered = f.mul(scale, f.mul(base, base))
    elif power == 3.0:
        # Square(base) * base, with the constant moved down into the second factor.
        powered = f.mul(f.mul(base, base), f.mul(scale, base))
    elif power == 0.5:
        powered = f.mul(f.sqrt(base), scale)
    else:
        powered = f.mul(scale, f.pow(base, power))
    return f.add(end, powered)


def cosine(lr: float, decay_steps: float, one_minus_alpha: float, alpha: float, step: int) -> float:
    s = f.minimum(f.f32(step), decay_steps)
    one_plus_cos = f.add(f.cos(f.mul(s, f.mul(_PI, reciprocal(decay_steps)))), 1.0)
    if alpha == 0.0:
        return f.mul(one_plus_cos, f.mul(0.5, lr))
    return f.mul(lr, f.add(alpha, f.mul(one_plus_cos, f.mul(0.5, one_minus_alpha))))


def cosine_restarts(
    lr: float, first_decay_steps: float, t_mul: float, m_mul: float, alpha: float, step: int
) -> float:
    completed = f.mul(f.f32(step), reciprocal(first_decay_steps))
    if t_mul == 1.0:
        restart = f.floor(completed)
        completed = f.sub(completed, restart)
    else:
        one_minus_t = f.sub(1.0, t_mul)
        log_ratio = f.log(f.sub(1.0, f.mul(one_minus_t, completed)))
        restart = f.floor(f.mul(log_ratio, reciprocal(f.log(t_mul))))
        sum_r = f.mul(reciprocal(one_minus_t), f.sub(1.0, f.pow(t_mul, restart)))
        completed = f.div(f.sub(completed, sum_r), f.pow(t_mul, restart))
    one_plus_cos = f.add(f.cos(f.mul(_PI, completed)), 1.0)
    m_fac = f.pow(m_mul, restart)
    if alpha == 0.0:
        return f.mul(one_plus_cos, f.mul(m_fac, f.mul(0.5, lr)))
    scale = f.mul(f.mul(0.5, f.sub(1.0, alpha)), m_fac)
    return f.mul(lr, f.add(alpha, f.mul(one_plus_cos, scale)))


def linear_cosine(
    lr: float,
    decay_steps: float,
    two_periods: float,
    alpha: float,
    beta: float,
    noise: tuple[float, float, float] | None,
    step: int,
) -> float:
    """``linear_cosine_decay``; with ``noise = (initial_variance, variance_decay, z)``, ``z`` the
    standard normal draw for this step, ``noisy_linear_cosine_decay``."""
    s = f.minimum(f.f32(step), decay_steps)
    r = reciprocal(decay_steps)
    one_plus_cos = f.add(f.cos(f.mul(s, f.mul(_PI, f.mul(two_periods, r)))), 1.0)
    if noise is None:
        if beta == 0.0 and alpha == 0.0:
            # lr * (linear * cosine): lr folds into the linear part's reciprocal.
            return f.mul(f.mul(one_plus_cos, 0.5), f.mul(f.sub(decay_steps, s), f.mul(lr, r)))
        linear = f.mul(r, f.sub(decay_steps, s))
        if alpha != 0.0:
            linear = f.add(alpha, linear)
    else:
        linear = f.mul(r, f.sub(decay_steps, s))
        # alpha + (linear + noise) is one AddN(alpha, noise, linear), summed in that order.
        term = _noise_term(*noise, s)
        first = term if alpha == 0.0 else f.add(alpha, term)
        linear = f.add(first, linear)
    if beta == 0.0:
        return f.mul(linear, f.mul(one_plus_cos, f.mul(0.5, lr)))
    return f.mul(lr, f.add(beta, f.mul(linear, f.mul(one_plus_cos, 0.5))))


def _noise_term(initial_variance: float, variance_decay: float, z: float, s: float) -> float:
    """``z * sqrt(initial_variance / (1 + s) ** variance_decay)``: TF's ``random_normal`` with a
    non-constant ``stddev``, whose ``+ mean`` (0) Grappler drops."""
    return f.mul(f.sqrt(f.div(initial_variance, f.pow(f.add(s, 1.0), variance_decay))), z)


def warmup(lr: float, warmup_steps: float, step: int) -> float:
    """BERT's ``lr * (step / warmup_steps)``: ``step * (lr * (1 / warmup_steps))``."""
    return f.mul(f.f32(step), f.mul(lr, reciprocal(warmup_steps)))
