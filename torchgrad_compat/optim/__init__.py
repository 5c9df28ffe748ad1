"""TensorFlow v1's optimizers as ``torch.optim.Optimizer`` subclasses with TF's exact numbers."""

from ._base import Optimizer
from .adam import AdamOptimizer
from .gradient_descent import GradientDescentOptimizer

__all__ = [
    "AdamOptimizer",
    "GradientDescentOptimizer",
    "Optimizer",
]
