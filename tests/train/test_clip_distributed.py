"""Clipping across replicas (CrossShardOptimizer) and across shards (DTensor, FSDP2), in 2 real
processes on 127.0.0.1 (the checks are in tests/train/_clip_workers.py)."""

from __future__ import annotations

import _clip_workers as workers
import pytest
from _procs import run_ranks

WORLD = 2
# A hung collective fails the run here (gloo's own timeout is 30 s).
DEADLINE_S = 120


@pytest.fixture(scope="module")
def verdicts() -> dict[str, dict[int, str | None]]:
    names = list(workers.CHECKS)
    messages = run_ranks(
        workers.run_checks,
        WORLD,
        lambda rank, port, results: (rank, WORLD, port, names, results),
        expected=WORLD * len(names),
        deadline_s=DEADLINE_S,
    )
    out: dict[str, dict[int, str | None]] = {name: {} for name in names}
    for name, rank, error in messages:
        out[name][rank] = error
    return out


@pytest.mark.parametrize("check", list(workers.CHECKS))
def test_two_ranks(verdicts, check):
    by_rank = verdicts[check]
    missing = [r for r in range(WORLD) if r not in by_rank]
    assert not missing, f"{check}: no verdict from ranks {missing} (crashed or hung)"
    failures = {r: e for r, e in by_rank.items() if e is not None}
    assert not failures, "\n".join(f"--- rank {r}:\n{e}" for r, e in failures.items())
