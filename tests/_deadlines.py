"""The tests' time bounds, scaled to how slow this machine runs now.

Every bound a test puts on a wait was set on a quiet 2-core machine; under
load (a busy CI runner, other jobs beside the suite) the same work takes
several times longer, and a bound that tells a hang from a quiet machine's
run would call a slow run a hang. ``scaled(seconds)`` multiplies a bound by
the machine's time scale: measured once per test session by timing a fixed
CPU-bound loop against its time on the quiet machine, never below 1 and at
most ``MAX_SCALE``, so a hang is still caught within ``MAX_SCALE`` times the
quiet bound. ``TORCHGRAD_COMPAT_TEST_TIME_SCALE`` overrides the measurement
(any number >= 1); the measured value is written there too, so the processes
a test starts use the session's scale instead of measuring again.

A bound on a library timeout the test expects to fire is scaled only on the
outer side: the timeout under test keeps its value (or is scaled itself when
the test's message does not name it), and what the test waits beyond it is
``scaled``.
"""

from __future__ import annotations

import os
import time

ENV = "TORCHGRAD_COMPAT_TEST_TIME_SCALE"
MAX_SCALE = 10.0
# Seconds _workload() takes on the quiet 2-core machine the tests' bounds were set on.
_REFERENCE_S = 0.12


def _workload() -> int:
    """Pure-Python arithmetic: one core's speed and the share of it this process gets, nothing else."""
    total = 0
    for i in range(1_000_000):
        total += i * i % 7
    return total


def time_scale() -> float:
    """How many times longer than on the quiet machine a test's work takes now: in ``[1, MAX_SCALE]``."""
    given = os.environ.get(ENV)
    if given is None:
        start = time.perf_counter()
        _workload()
        scale = min(MAX_SCALE, max(1.0, (time.perf_counter() - start) / _REFERENCE_S))
        os.environ[ENV] = f"{scale:.2f}"
        return float(os.environ[ENV])
    try:
        scale = float(given)
    except ValueError:
        scale = float("nan")
    if not scale >= 1.0 or scale == float("inf"):
        raise ValueError(f"Invalid {ENV} value: {given!r}; expected a finite number >= 1")
    return scale


def scaled(seconds: float) -> float:
    """``seconds``, a bound set on the quiet machine, stretched by the session's ``time_scale()``."""
    return seconds * time_scale()
