"""FSDP2 (``fully_shard``), DCP under FSDP2 and ZeroRedundancyOptimizer with two real gloo ranks.

One process group runs every check of tests/optim/_fsdp2_workers.py (each over every
optimizer configuration); each test reads one check's verdict from both ranks.

- TF-style ``minimize`` on FSDP2 parameters raises a clear error (FSDP2 gradients
  come only through ``backward()``); ``apply_gradients`` of those gradients works;
- every optimizer, reference and foreach paths, steps on FSDP2-sharded
  parameters (one with an empty shard on rank 1) bit for bit as the unsharded run;
- ``get_state_dict``/``dcp.save`` then ``dcp.load``/``set_state_dict`` into a
  fresh FSDP2 model resumes bitwise (every optimizer, and a LossScaleOptimizer), and
  so do full (gathered) state dicts (``full_state_dict=True``);
- ``ZeroRedundancyOptimizer`` consolidated on rank 0 and loaded on both ranks
  resumes bitwise (every optimizer, and a LossScaleOptimizer around it).

Sparse gradients do not arise under FSDP2 (its gradients are dense DTensors).
"""

from __future__ import annotations

import _fsdp2_workers as workers
import pytest
from _procs import run_ranks

WORLD = 2
CHECKS = list(workers.CHECKS)
# A group silent this long (scaled) is hung: a hung collective fails the run instead of stalling it.
DEADLINE_S = 150


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[str, dict[int, str | None]]:
    tmp = str(tmp_path_factory.mktemp("fsdp2"))
    messages = run_ranks(
        workers.run_checks,
        WORLD,
        lambda rank, port, results: (rank, WORLD, port, CHECKS, tmp, results),
        expected=WORLD * len(CHECKS),
        deadline_s=DEADLINE_S,
    )
    out: dict[str, dict[int, str | None]] = {name: {} for name in CHECKS}
    for name, rank, error in messages:
        out[name][rank] = error
    return out


@pytest.mark.parametrize("check", CHECKS)
def test_two_ranks(verdicts, check):
    by_rank = verdicts[check]
    missing = [r for r in range(WORLD) if r not in by_rank]
    assert not missing, f"{check}: no verdict from ranks {missing} (crashed or hung)"
    failures = {r: e for r, e in by_rank.items() if e is not None}
    assert not failures, "\n".join(f"--- rank {r}:\n{e}" for r, e in failures.items())
