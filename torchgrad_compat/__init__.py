"""torchgrad_compat: TensorFlow v1's training stack rebuilt natively on PyTorch."""

from . import amp, checkpoint, optim, train, xla
from .gradients import AggregationMethod, UnconnectedGradients, gradients, hessian_vector_product, hessians

__all__ = [
    "AggregationMethod",
    "UnconnectedGradients",
    "amp",
    "checkpoint",
    "gradients",
    "hessian_vector_product",
    "hessians",
    "optim",
    "train",
    "xla",
]
__version__ = "0.1.0"
