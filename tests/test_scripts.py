"""Smoke test of the README's "run it" command: scripts/train.py trains and the loss falls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
SUMMARY = re.compile(r"^done: .* training loss (\d+\.\d+) -> (\d+\.\d+), held-out accuracy", re.MULTILINE)


# Adam: the dense rule and its non-lazy sparse rule, torch style; Ftrl: a variable
# computed from its accumulators, with l1, TF style; Momentum under bfloat16 autocast
# with dynamic loss scaling. Each run costs ~3 s, mostly importing torch, so three
# are enough here; tests/ covers every optimizer.
@pytest.mark.parametrize(
    ("optimizer", "style", "extra"),
    [("adam", "torch", []), ("ftrl", "tf", []), ("momentum", "torch", ["--loss-scale", "dynamic"])],
)
def test_train_script_reduces_loss(optimizer: str, style: str, extra: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(TRAIN), "--optimizer", optimizer, "--style", style, "--steps", "30", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    match = SUMMARY.search(result.stdout)
    assert match, f"no summary line in:\n{result.stdout}"
    first, last = float(match[1]), float(match[2])
    assert last < 0.8 * first, result.stdout
