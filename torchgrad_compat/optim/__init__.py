"""TensorFlow v1's optimizers as ``torch.optim.Optimizer`` subclasses with TF's exact numbers."""

from ._replay import set_step_replay
from .adadelta import AdadeltaOptimizer
from .adagrad import AdagradOptimizer
from .adagrad_da import AdagradDAOptimizer
from .adam import AdamOptimizer
from .ftrl import FtrlOptimizer
from .gradient_descent import GradientDescentOptimizer
from .momentum import MomentumOptimizer
from .optimizer import Optimizer
from .proximal_adagrad import ProximalAdagradOptimizer
from .proximal_gradient_descent import ProximalGradientDescentOptimizer
from .rmsprop import RMSPropOptimizer

__all__ = [
    "AdadeltaOptimizer",
    "AdagradDAOptimizer",
    "AdagradOptimizer",
    "AdamOptimizer",
    "FtrlOptimizer",
    "GradientDescentOptimizer",
    "MomentumOptimizer",
    "Optimizer",
    "ProximalAdagradOptimizer",
    "ProximalGradientDescentOptimizer",
    "RMSPropOptimizer",
    "set_step_replay",
]
