"""The Python blocks of README.md and of the pages in docs/, for the tests that run them as written."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md, then every page of docs/ by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


def page_name(page: Path) -> str:
    """The page's path from the repository root, as the tests name it: ``docs/amp.md``."""
    return page.relative_to(ROOT).as_posix()


def python_blocks(page: Path = README) -> list[tuple[int, str]]:
    """``(line, source)`` of each fenced ``python`` block of ``page``, dedented (list items indent theirs)."""
    text = page.read_text()
    found = []
    for match in re.finditer(r"^( *)```python\n(.*?)^\1```$", text, flags=re.M | re.S):
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, textwrap.dedent(match.group(2))))
    return found


def all_python_blocks() -> list[tuple[str, int, str]]:
    """``(page name, line, source)`` of every Python block of every page."""
    return [(page_name(page), line, source) for page in pages() for line, source in python_blocks(page)]


def is_trainer_recipe(source: str) -> bool:
    """A recipe for a trainer package (Lightning, Hugging Face), which
    tests/amp/test_loss_scale_trainers.py runs."""
    return any(
        marker in source for marker in ("import lightning", "from transformers", "self.manual_backward")
    )


def run_block(containing: str, **namespace: Any) -> dict[str, Any]:
    """Execute the one block (of any page) holding ``containing`` in ``namespace``; return the namespace."""
    (match,) = [block for block in all_python_blocks() if containing in block[2]]
    name, line, source = match
    exec(compile(source, f"{name}:{line}", "exec"), namespace)
    return namespace
