"""The typed user script (``tests/_typed_usage.py``): it runs, and a user's type checker accepts it."""

from __future__ import annotations

import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torchgrad_compat

SCRIPT = Path(__file__).with_name("_typed_usage.py")


def test_typed_usage_runs():
    runpy.run_path(str(SCRIPT), run_name="__main__")


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_typed_usage_passes_mypy_strict(tmp_path: Path):
    # A copy outside the checkout, and the package's directory on PYTHONPATH (an editable
    # install's import hook is invisible to mypy): mypy then takes the package as a user's
    # checker does, installed, through py.typed, not as source files of the script's project.
    shutil.copy(SCRIPT, tmp_path)
    package_root = str(Path(torchgrad_compat.__file__).parents[1])
    # torch's own Tensor.backward is unannotated: --strict would flag every call to it.
    command = [sys.executable, "-m", "mypy", "--strict", "--untyped-calls-exclude=torch", "--no-incremental"]
    result = subprocess.run(
        [*command, SCRIPT.name],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": package_root},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
