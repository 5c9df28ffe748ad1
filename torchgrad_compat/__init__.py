"""torchgrad_compat: TensorFlow v1's training stack rebuilt natively on PyTorch."""

from . import optim

__all__ = ["optim"]
__version__ = "0.1.0"
