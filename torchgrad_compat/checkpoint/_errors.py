"""The errors of a checkpoint load: a file it cannot trust, or one that does not hold what is asked."""

from __future__ import annotations


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated, malformed or fails its CRC32C check.

    Attributes:
        problems: from ``load_tf_checkpoint``, every tensor that cannot be read,
            name -> why; empty when the index itself is unreadable.
    """

    def __init__(self, message: str, problems: dict[str, str] | None = None):
        super().__init__(message)
        self.problems = dict(problems or {})


class CheckpointMismatchError(ValueError):
    """The checkpoint does not hold what ``var_map`` and the optimizer ask for.

    Raised by ``load_tf_checkpoint`` before anything is written: a name is
    missing, a shape (after the layout) or dtype differs, or a tensor's dtype
    has no torch counterpart (TF's ``resource``, ``variant``, ``string``...).

    Attributes:
        problems: every offending checkpoint name -> why, sorted by name.
    """

    def __init__(self, message: str, problems: dict[str, str]):
        super().__init__(message)
        self.problems = dict(sorted(problems.items()))
