"""TensorFlow v1's training helpers (``tf.compat.v1.train``) with TF's exact numbers: learning-rate decays."""

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
from .scheduler import DecayLR

__all__ = [
    "DecayLR",
    "LearningRateDecay",
    "cosine_decay",
    "cosine_decay_restarts",
    "exponential_decay",
    "inverse_time_decay",
    "linear_cosine_decay",
    "linear_warmup",
    "natural_exp_decay",
    "noisy_linear_cosine_decay",
    "piecewise_constant",
    "polynomial_decay",
]
