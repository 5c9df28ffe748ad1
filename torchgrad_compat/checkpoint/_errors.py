"""The error every checkpoint reader raises for a file it cannot trust."""

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
