"""AGN's shape and first steps: modules importing in one direction, a launch without torchrun."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from torchgrad_compat.agn import init_rpc_from_env

AGN = Path(__file__).resolve().parents[2] / "torchgrad_compat" / "agn"


def _imports(module: Path) -> set[str]:
    """The sibling modules ``module`` imports, under ``TYPE_CHECKING`` and inside functions too."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                found.update(alias.name for alias in node.names)
            else:
                found.add(node.module.split(".")[0])
    return found


def test_agn_modules_do_not_import_each_other_in_a_cycle():
    graph = {p.stem: _imports(p) for p in AGN.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            pytest.fail(f"agn modules import each other: {' -> '.join(cycle)}")
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_init_rpc_from_env_outside_torchrun_says_what_is_missing_and_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK and WORLD_SIZE and MASTER_PORT are not set: launch") as info:
        init_rpc_from_env()
    assert "torchrun --nproc-per-node 3 script.py" in str(info.value)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(RuntimeError, match="and RANK is not set: launch every process with torchrun"):
        init_rpc_from_env()
    for name, value, expected in (
        ("RANK", "one", r"Invalid RANK value: 'one' \(from the environment\); expected an int in \[0, 3\)"),
        ("RANK", "3", r"Invalid RANK value: '3'"),
        ("MASTER_PORT", "70000", r"Invalid MASTER_PORT value: '70000'.*\[1, 65536\)"),
    ):
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=expected):
            init_rpc_from_env()
        monkeypatch.setenv("MASTER_PORT", "29500")
