"""Every Python block in README.md runs as written.

The blocks read as one session, in order: a block may use what an earlier one
defined (``model``, ``AdamOptimizer``, ...). A block that starts a job from
torchrun's environment (``init_rpc_from_env``) is a program of its own and runs
under ``torch.distributed.run`` with three processes on 127.0.0.1. The recipes
for Lightning and Hugging Face's Trainer run inside those trainers, in
tests/test_loss_scale_trainers.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _procs import torchrun
from _readme import is_trainer_recipe, python_blocks

TORCHRUN_DEADLINE_S = 120
SESSION_DEADLINE_S = 300


def _is_program(source: str) -> bool:
    return "init_rpc_from_env()" in source


def test_readme_has_python_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 5, [line for line, _ in blocks]
    assert sum(_is_program(s) for _, s in blocks) == 1
    # Lightning's plugin and manual optimization, Hugging Face's Trainer.
    assert sum(is_trainer_recipe(s) for _, s in blocks) == 3


def test_session_blocks_run_in_order(tmp_path):
    """One interpreter runs the blocks one after another, in one namespace, as a reader would."""
    blocks = [(line, s) for line, s in python_blocks() if not (_is_program(s) or is_trainer_recipe(s))]
    driver = tmp_path / "session.py"
    driver.write_text(
        "import sys\n"
        f"blocks = {blocks!r}\n"
        "namespace = {'__name__': '__main__'}\n"
        "for line, source in blocks:\n"
        "    try:\n"
        "        exec(compile(source, f'README.md:{line}', 'exec'), namespace)\n"
        "    except BaseException:\n"
        "        print(f'README.md block at line {line} failed', file=sys.stderr)\n"
        "        raise\n"
    )
    result = subprocess.run(
        [sys.executable, str(driver)],
        capture_output=True,
        text=True,
        timeout=SESSION_DEADLINE_S,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("line", [line for line, source in python_blocks() if _is_program(source)])
def test_torchrun_block_runs_under_torchrun(tmp_path, line):
    source = dict(python_blocks())[line]
    program = tmp_path / "readme_job.py"
    program.write_text(source)
    returncode, output = torchrun([str(program)], nproc=3, deadline_s=TORCHRUN_DEADLINE_S, cwd=tmp_path)
    assert returncode == 0, f"README.md block at line {line}:\n{output[-4000:]}"
