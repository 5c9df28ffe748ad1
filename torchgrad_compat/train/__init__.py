"""TensorFlow v1's training helpers (``tf.compat.v1.train``) with TF's exact numbers: learning-rate
decays, gradient clipping and exponential moving averages."""

from .clip_ops import (
    clip_by_global_norm,
    clip_by_global_norm_,
    clip_by_norm,
    clip_by_value,
    global_norm,
    sum_of_squares,
)
from .learning_rate_decay import (
    LearningRateDecay,
    cosine_decay,
    cosine_decay_restarts,
    exponential_decay,
    inverse_time_decay,
    linear_cosine_decay,
    linear_warmup,
    natural_exp_decay,
    noisy_linear_cosine_decay,
    piecewise_constant,
    polynomial_decay,
)
from .moving_averages import ExponentialMovingAverage
from .scheduler import DecayLR

__all__ = [
    "DecayLR",
    "ExponentialMovingAverage",
    "LearningRateDecay",
    "clip_by_global_norm",
    "clip_by_global_norm_",
    "clip_by_norm",
    "clip_by_value",
    "cosine_decay",
    "cosine_decay_restarts",
    "exponential_decay",
    "global_norm",
    "inverse_time_decay",
    "linear_cosine_decay",
    "linear_warmup",
    "natural_exp_decay",
    "noisy_linear_cosine_decay",
    "piecewise_constant",
    "polynomial_decay",
    "sum_of_squares",
]
