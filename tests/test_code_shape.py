"""The shape the code keeps (issue 24): no import circle among zerokit's files (a circle is how one concern starts to
need another's internals), counting every import Python may run: at module level, inside a function, only for type
checking, and a package's face (its __init__) importing its own submodules (issue 43: three circles passed through
those last two). No function over 60 lines and no class over 200 (counted from the `class` line to its last,
docstrings included). The package shows its floors (issue 43): at most 4 modules loose at zerokit/'s root, and each room
imports only rooms on its own floor or below. Read from the source with ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "zerokit"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 200
MAX_LOOSE_MODULES = 4
FLOORS = [  # from the bottom; zerokit's face imports only _support/ (its public names are strings, imported on use)
    {"zerokit", "_support"},
    {"config"},
    {"comm"},
    {"parallel", "flat", "precision"},
    {"tiers"},
    {"masters"},
    {"stages"},
    {"checkpoint", "reliability", "observe"},
    {"engine"},
    {"pipeline", "deepspeed", "integrations", "profiling", "testing", "cli", "demo", "planner", "__main__"},
]
CLIMBS = {("zerokit.engine.engine", "zerokit.profiling.report")}  # known, inside a function: Engine.plan_report


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(name: str, modules: dict[str, Path]) -> str | None:
    """The zerokit module an imported name lives in (`zerokit.a.b.Name` -> `zerokit.a.b`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _imported(name, modules)
            if target and target != module:
                found.add(target)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_among_zerokits_files() -> None:
    modules = _modules()
    graph = {module: _imports(module, path, modules) for module, path in modules.items()}
    assert sum(len(targets) for targets in graph.values()) > 300  # the reading finds the imports
    assert _circles(graph) == []


def test_the_support_leaves_import_nothing_of_zerokit() -> None:
    """zerokit/_support/ is what any room may import (the logger among them), so it must import no room."""
    modules = _modules()
    leaves = {module: _imports(module, path, modules) for module, path in modules.items()
              if module == "zerokit._support" or module.startswith("zerokit._support.")}
    assert "zerokit._support.log" in leaves
    assert {module: targets for module, targets in leaves.items() if targets} == {}


def test_at_most_4_modules_are_loose_at_the_root() -> None:
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_each_room_imports_only_its_floor_or_below() -> None:
    modules = _modules()
    floor = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
    assert {_room(module) for module in modules} <= set(floor)  # every room has its floor
    climbs = {(module, target) for module, path in modules.items() for target in _imports(module, path, modules)
              if floor[_room(target)] > floor[_room(module)]}
    assert climbs == CLIMBS


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_reading_counts_a_face_importing_its_submodules_and_type_only_imports(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    sources = {"pkg": ("__init__.py", "from pkg.sub import Thing\nfrom . import other\n"),
               "pkg.sub": ("sub.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import Face\n"),
               "pkg.other": ("other.py", "def late():\n    import pkg.sub\n")}
    modules = {}
    for module, (name, text) in sources.items():
        modules[module] = tmp_path / "pkg" / name
        modules[module].write_text(text)
    graph = {module: _imports(module, path, modules) for module, path in modules.items()}
    assert graph == {"pkg": {"pkg.sub", "pkg.other"}, "pkg.sub": {"pkg"}, "pkg.other": {"pkg.sub"}}
    assert _circles(graph) == [["pkg", "pkg.other", "pkg.sub"]]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_over_60_lines(path: Path) -> None:
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_class_over_200_lines(path: Path) -> None:
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert long == []
