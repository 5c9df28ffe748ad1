"""TensorFlow's cross-replica gradient sums: ``CrossShardOptimizer`` over torch.distributed or torch_xla."""

from .cross_shard_optimizer import CrossShardOptimizer

__all__ = ["CrossShardOptimizer"]
