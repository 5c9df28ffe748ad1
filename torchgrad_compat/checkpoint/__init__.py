"""TensorFlow checkpoints in and out, optimizer state included, without TensorFlow.

``list_tf_checkpoint`` and ``load_tf_checkpoint`` read TF's tensor bundle
(``<prefix>.index`` + ``<prefix>.data-*``) directly; ``save_tf_checkpoint``
writes one that ``tf.compat.v1.train.Saver`` restores. ``suggest_var_map``
drafts the name map from a module.

Checkpoints come from other people and live in shared directories, so a
load trusts nothing in the files: a malformed index, state file or tensor is
refused with a ``CorruptCheckpointError`` naming the file and the entry, in
memory bounded by the files' size, before anything is changed. A save writes
under fresh temporary names and renames into place last: one that fails
leaves nothing new, and it refuses up front whatever a load could not read
back (see :func:`save_tf_checkpoint`).

Example: a TF Dense layer and its Adam state, out and back in.

    >>> import tempfile, torch
    >>> from torchgrad_compat.optim import AdamOptimizer
    >>> layer = torch.nn.Linear(3, 2)
    >>> opt = AdamOptimizer(layer.parameters(), learning_rate=0.1)
    >>> layer(torch.ones(1, 3)).sum().backward(); opt.step()
    >>> var_map = {"dense/kernel": (layer.weight, "transpose"), "dense/bias": layer.bias}
    >>> tmp = tempfile.TemporaryDirectory()
    >>> folder = tmp.name
    >>> _ = save_tf_checkpoint(f"{folder}/model.ckpt-1", var_map, opt, global_step=1)
    >>> [name for name, shape, dtype in list_tf_checkpoint(folder)]  # doctest: +NORMALIZE_WHITESPACE
    ['beta1_power', 'beta2_power', 'dense/bias', 'dense/bias/Adam', 'dense/bias/Adam_1',
     'dense/kernel', 'dense/kernel/Adam', 'dense/kernel/Adam_1', 'global_step']
    >>> copy = torch.nn.Linear(3, 2)
    >>> copy_opt = AdamOptimizer(copy.parameters(), learning_rate=0.1)
    >>> copy_map = {"dense/kernel": (copy.weight, "transpose"), "dense/bias": copy.bias}
    >>> info = load_tf_checkpoint(folder, copy_map, copy_opt)
    >>> info.global_step, info.unused, torch.equal(copy.weight, layer.weight)
    (1, [], True)
    >>> tmp.cleanup()
"""

from ._bundle import CorruptCheckpointError
from ._errors import CheckpointMismatchError
from ._load import LoadInfo, list_tf_checkpoint, load_tf_checkpoint
from ._save import save_tf_checkpoint
from ._suggest import AmbiguousVarMapError, SuggestedVarMap, suggest_var_map

__all__ = [
    "AmbiguousVarMapError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "LoadInfo",
    "SuggestedVarMap",
    "list_tf_checkpoint",
    "load_tf_checkpoint",
    "save_tf_checkpoint",
    "suggest_var_map",
]
