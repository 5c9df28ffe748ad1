"""Loss scaling for mixed precision, as TensorFlow v1's ``tf.compat.v1.mixed_precision``."""

from .loss_scale import DynamicLossScale, FixedLossScale, LossScale
from .loss_scale_optimizer import LossScaleOptimizer

__all__ = ["DynamicLossScale", "FixedLossScale", "LossScale", "LossScaleOptimizer"]
