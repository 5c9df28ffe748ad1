"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _deadlines import ENV, scaled, time_scale
from _fused_engine import small_chunks

# torch's autograd engine sizes its per-device queues at its first backward pass, counting the
# devices each backend reports then: a backward on an XLA device after a CPU one fails an
# internal assert unless torch_xla's runtime (and so its device count) was up first.
if importlib.util.find_spec("torch_xla") is not None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    torch_xla.device()


def pytest_configure(config: pytest.Config) -> None:
    # Measured before any test adds load of its own; the processes tests start inherit it.
    time_scale()


def pytest_report_header(config: pytest.Config) -> str:
    return f"time bounds scaled by {time_scale():.2f} ({ENV})"


# Set by CI's TensorFlow step (``pytest -m tf_live``): there a live test that skips fails instead, so
# that a step meant to rerun TensorFlow cannot pass having run none of it.
REQUIRE_TF = "TORCHGRAD_COMPAT_REQUIRE_TF"


@pytest.hookimpl(hookwrapper=True)  # (not wrapper=True: setup.cfg allows pytest 7)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    # (An expected failure reports as skipped too: it keeps its outcome.)
    skipped = report.skipped and not hasattr(report, "wasxfail")
    if skipped and os.environ.get(REQUIRE_TF) == "1" and item.get_closest_marker("tf_live"):
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_TF}=1, yet this tf_live test skipped: {report.longrepr}"


@pytest.fixture
def tf_python(request: pytest.FixtureRequest) -> str:
    """An interpreter with real TensorFlow: this one when it can import tensorflow, else the one
    named by ``TORCHGRAD_COMPAT_TF_PYTHON`` (TensorFlow and torch need not share an
    environment); with neither, the test is skipped. Only ``tf_live`` tests may ask for it: CI
    runs README's command without TensorFlow, then ``-m tf_live`` with it."""
    if request.node.get_closest_marker("tf_live") is None:
        pytest.fail(f"{request.node.nodeid} uses TensorFlow: mark it @pytest.mark.tf_live")
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable
    python = os.environ.get("TORCHGRAD_COMPAT_TF_PYTHON")
    if python is None:
        pytest.skip(
            "tensorflow is not importable here; set TORCHGRAD_COMPAT_TF_PYTHON to an interpreter that has it"
        )
    return python


@pytest.fixture
def run_tf_generator(tmp_path: Path, tf_python: str) -> Callable[[Path], Path]:
    """Run a committed fixture generator under real TensorFlow (``tf_python``), writing into ``tmp_path``."""

    def run(generator: Path) -> Path:
        result = subprocess.run(
            [tf_python, str(generator), "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=scaled(600),
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return tmp_path

    return run


@pytest.fixture(autouse=True)
def small_fused_chunks() -> Iterator[None]:
    """``fused=True`` compiles its kernels for chunks of 4 tensors in every test: half the compile
    time of the default chunk's, and one kernel per rule and dtypes for the whole suite (the
    compiled code is shared through Inductor's cache between test files and processes)."""
    with small_chunks():
        yield
