"""The package's shape: modules of a readable size, imports in layers, public seams between packages.

Read from the sources (nothing is imported): every ``import`` and ``from ... import`` at run time
(those under ``if TYPE_CHECKING:`` are for annotations only and left out).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchgrad_compat"
# The private torch APIs, one module shared by every subpackage (see its docstring).
SHARED_PRIVATE = {"torchgrad_compat._torch_internals"}
MAX_LINES = 800
CYCLES: set[tuple[str, ...]] = set()
PRIVATE_IN_SCRIPTS = {
    # --torch-sqrt: the eager step with torch's square root, as a compiled graph computes it.
    ("compile_breaks.py", "torchgrad_compat.optim._numerics"),
    # The table reads the bundle and the non-slot state as the loader does.
    ("tf_checkpoint_table.py", "torchgrad_compat.checkpoint._bundle"),
    ("tf_checkpoint_table.py", "torchgrad_compat.checkpoint._mapping"),
    # The fault catalogue crafts hostile files with the table's own encoder.
    ("fault_cases_checkpoint.py", "torchgrad_compat.checkpoint"),
    ("fault_cases_checkpoint.py", "torchgrad_compat.checkpoint._bundle"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _runtime_imports(name: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of each import the module makes at run time, resolved to absolute names."""
    tree = ast.parse(MODULES[name].read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    base = name.split(".") if _is_package(name) else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                target = ".".join([*prefix, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.append((target, [alias.name for alias in node.names]))
    return found


def _edges() -> dict[str, set[str]]:
    """Which of the package's modules each one imports (a name imported from a package that is one
    of its modules counts as that module)."""
    edges: dict[str, set[str]] = {}
    for name in MODULES:
        targets = set()
        for target, names in _runtime_imports(name):
            if target not in MODULES:
                continue
            for imported in names or [""]:
                sub = f"{target}.{imported}"
                targets.add(sub if sub in MODULES else target)
        edges[name] = targets - {name}
    return edges


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_reads_in_one_sitting(name: str):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


def test_no_import_cycles():
    edges = _edges()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                if tuple(sorted(set(cycle))) not in CYCLES:
                    pytest.fail("import cycle: " + " -> ".join(cycle))
                continue
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_no_module_imports_its_own_package_back():
    for name in MODULES:
        if _is_package(name):
            continue
        package = name.rsplit(".", 1)[0]
        for target, names in _runtime_imports(name):
            own = target == package and not all(f"{package}.{n}" in MODULES for n in names)
            parent = package.startswith(f"{target}.") and package.rsplit(".", 1)[1] in names
            assert not (own or parent), f"{name} imports its own package {package} back"


def _subpackage(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else name


def test_packages_use_each_others_public_names_only():
    offences = []
    for name in MODULES:
        home = _subpackage(name)
        for target, names in _runtime_imports(name):
            if not target.startswith("torchgrad_compat") or _subpackage(target) == home:
                continue
            if target in SHARED_PRIVATE or target == "torchgrad_compat":
                continue
            private_module = any(part.startswith("_") for part in target.split(".")[1:])
            private_names = [n for n in names if n.startswith("_")]
            if private_module or private_names:
                offences.append(f"{name}: from {target} import {', '.join(names)}")
    assert not offences, "imports of another package's private names:\n" + "\n".join(offences)


def test_scripts_use_public_names_only():
    offences = []
    for path in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchgrad_compat"):
                imported = [(node.module, [a.name for a in node.names])]
            elif isinstance(node, ast.Import):  # (import torchgrad_compat.x._y as z)
                imported = [(a.name, []) for a in node.names if a.name.startswith("torchgrad_compat")]
            else:
                continue
            for module, names in imported:
                parts = module.split(".")[1:]
                private = any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names)
                if private and (path.name, module) not in PRIVATE_IN_SCRIPTS:
                    offences.append(f"{path.name}: from {module} import {', '.join(names)}")
    assert not offences, "\n".join(offences)


# The tests that may name the fused engine's private modules: its own, and the one place the
# other tests change its settings through.
FUSED_ENGINE_TESTS = {"tests/optim/test_fused.py", "tests/_fused_engine.py"}


def test_only_the_engines_own_tests_reach_into_it():
    offences = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in FUSED_ENGINE_TESTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            engine = [m for m in modules if m.startswith("torchgrad_compat.optim._fused")]
            offences += [f"{path.relative_to(ROOT)}: {m}" for m in engine]
    assert not offences, "set the fused engine up through tests/_fused_engine.py:\n" + "\n".join(offences)
