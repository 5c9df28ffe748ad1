"""The fused engine's settings as tests outside the engine's own change them, in one place.

Every test compiles the engine's kernels for chunks of 4 tensors (tests/conftest.py; spawned
ranks call :func:`use_small_chunks`), which compile in half the time of the default chunk's,
and a few start from no compiled kernel. Only this module
and the engine's own tests (tests/optim/test_fused.py) name the engine's private modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

import torchgrad_compat.optim._fused.config as _config
import torchgrad_compat.optim._fused.kernel as _kernel
import torchgrad_compat.optim._fused.run as _run

# Tensors per compiled call in tests: quick to compile, and a few tensors already span chunks.
TEST_CHUNK = 4


@contextlib.contextmanager
def small_chunks(chunk: int = TEST_CHUNK) -> Iterator[None]:
    """Fused kernels over ``chunk`` tensors per call inside the block (in this process)."""
    saved, _config.FUSED_CHUNK = _config.FUSED_CHUNK, chunk
    try:
        yield
    finally:
        _config.FUSED_CHUNK = saved


def use_small_chunks() -> None:
    """:func:`small_chunks` for the rest of a process: a spawned rank's first call."""
    _config.FUSED_CHUNK = TEST_CHUNK


def forget_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start from no compiled kernel for the rest of the test (so that dynamo sees the first call,
    which it does not for a kernel another test of this process compiled)."""
    monkeypatch.setattr(_kernel._FusedKernel, "_compiled", {})


def record_unscaling_kernels(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """A list that gets each rule the engine runs with the gradients' unscale folded into its
    kernels (a loss scale's fixed scale), for the rest of the test."""
    rules: list[object] = []
    unscaling = _run._unscaling
    monkeypatch.setattr(_run, "_unscaling", lambda single: rules.append(single) or unscaling(single))
    return rules
