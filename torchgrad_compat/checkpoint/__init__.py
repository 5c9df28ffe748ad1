"""TensorFlow checkpoints in and out, optimizer state included, without TensorFlow.

``list_tf_checkpoint`` and ``load_tf_checkpoint`` read TF's tensor bundle
(``<prefix>.index`` + ``<prefix>.data-*``) directly; ``save_tf_checkpoint``
writes one that ``tf.compat.v1.train.Saver`` restores.
"""

from ._bundle import CorruptCheckpointError
from ._suggest import suggest_var_map
from ._tf_checkpoint import LoadInfo, list_tf_checkpoint, load_tf_checkpoint, save_tf_checkpoint

__all__ = [
    "CorruptCheckpointError",
    "LoadInfo",
    "list_tf_checkpoint",
    "load_tf_checkpoint",
    "save_tf_checkpoint",
    "suggest_var_map",
]
