"""The tests' own time bounds: the session's time scale, and process groups bounded by their silence."""

from __future__ import annotations

import os
import time
from typing import Any

import _deadlines
import pytest
from _deadlines import ENV, MAX_SCALE, scaled, time_scale
from _procs import STARTUP_S, run_ranks


def test_the_scale_is_measured_once_within_its_bounds_and_handed_to_child_processes(monkeypatch):
    monkeypatch.delenv(ENV)
    scale = time_scale()
    assert 1.0 <= scale <= MAX_SCALE
    assert float(os.environ[ENV]) == scale
    monkeypatch.setattr(_deadlines, "_workload", lambda: pytest.fail("measured twice"))
    assert time_scale() == scale and scaled(2.0) == 2.0 * scale


def test_a_given_scale_is_used_and_a_bad_one_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ENV, "25")
    assert scaled(2.0) == 50.0
    for bad in ("0.5", "fast", "nan", "inf", ""):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=f"Invalid {ENV} value: {bad!r}; expected a finite number >= 1"):
            time_scale()


def _ticks(rank: int, results: Any, gaps: list[float]) -> None:
    """Report at once, then once after each of ``gaps`` seconds."""
    results.put(0)
    for k, gap in enumerate(gaps, 1):
        time.sleep(gap)
        results.put(k)


def _tick_group(gaps: list[float], expected: int) -> tuple[list[Any], float]:
    """What one ``_ticks`` process reported under ``run_ranks(deadline_s=2.0)``, and the seconds it took."""
    start = time.monotonic()
    messages = run_ranks(
        _ticks, 1, lambda rank, port, results: (rank, results, gaps), expected=expected, deadline_s=2.0
    )
    return messages, time.monotonic() - start


def test_a_group_that_keeps_reporting_runs_past_its_bound_and_a_silent_one_is_cut_off():
    silence = scaled(2.0)
    messages, seconds = _tick_group([silence / 2] * 4, 5)
    assert messages == [0, 1, 2, 3, 4] and seconds > 2 * silence
    messages, seconds = _tick_group([silence / 2, 1000], 3)
    assert messages == [0, 1] and seconds < silence / 2 + silence + scaled(STARTUP_S)
