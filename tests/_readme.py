"""README.md's Python blocks, for the tests that run them as written."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[tuple[int, str]]:
    """``(line, source)`` of every fenced ``python`` block, dedented (list items indent theirs)."""
    text = README.read_text()
    found = []
    for match in re.finditer(r"^( *)```python\n(.*?)^\1```$", text, flags=re.M | re.S):
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, textwrap.dedent(match.group(2))))
    return found


def is_trainer_recipe(source: str) -> bool:
    """A recipe for a trainer package (Lightning, Hugging Face): tests/test_loss_scale_trainers.py runs it."""
    return any(
        marker in source for marker in ("import lightning", "from transformers", "self.manual_backward")
    )


def run_block(containing: str, **namespace: Any) -> dict[str, Any]:
    """Execute the one block that contains ``containing``, in ``namespace``; the namespace afterwards."""
    (match,) = [(line, source) for line, source in python_blocks() if containing in source]
    line, source = match
    exec(compile(source, f"README.md:{line}", "exec"), namespace)
    return namespace
