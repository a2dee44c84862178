"""The shape the code keeps (issue 24): no import circle among zerokit's files (a circle is how one concern starts to
need another's internals), counting every import Python may run: at module level, inside a function, only for type
checking, and a package's face (its __init__) importing its own submodules (issue 43: three circles passed through
those last two). No function over 60 lines and no class over 200 (counted from the `class` line to its last,
docstrings included); no line over 120 characters. The package shows its floors (issue 43): at most 4 modules loose
at zerokit/'s root, and each room imports only rooms on its own floor or below. No room below the engine names the whole ZeroConfig or reads a DeepSpeed
key (issue 43). Read from the source with ast; nothing is imported but the DeepSpeed reader's schema, for its keys."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "zerokit"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 200
MAX_LINE_CHARACTERS = 120
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


def test_no_line_over_120_characters() -> None:
    long = [f"{path.relative_to(PACKAGE)}:{number}" for path in sorted(PACKAGE.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > MAX_LINE_CHARACTERS]
    assert long == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_class_over_200_lines(path: Path) -> None:
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert long == []


# --- the config is read once, and each room gets its part (issue 43) ------------------------------------------------
FACES_ONLY = ("zerokit", "zerokit.engine", "zerokit.config")
"""Packages that, named below, stand for their face (__init__) only: their other modules are named one by one."""
ABOVE_THE_ENGINE = ("zerokit", "zerokit.__main__", "zerokit.engine", "zerokit.engine.engine", "zerokit.engine.build",
                    "zerokit.engine.checkpoints", "zerokit.engine.backward", "zerokit.engine.state",
                    "zerokit.deepspeed", "zerokit.integrations", "zerokit.pipeline", "zerokit.profiling", "zerokit.cli",
                    "zerokit.demo", "zerokit.testing")
"""The engine and what sits on it (the drop-ins, the pipeline, profiling a run, the commands, the test helpers): these
may take the whole ZeroConfig. Every other module is a room below the engine, or the config itself; engine/'s step.py,
schedules.py, activations.py and startup.py sit in the engine's folder but take only their parts (StepSettings, the
activation block, the stage's lines), like any room below it."""
THE_CONFIG = ("zerokit.config", "zerokit.config.typed", "zerokit.config.resolve", "zerokit.config.dsconfig")
"""The config room: the typed config (config/typed.py) and the DeepSpeed reader (config/dsconfig/), the only code that
knows DeepSpeed's keys; resolve(config, facts) in config/resolve.py makes each room's part (config/settings.py, which
is a torch-free room like the others: it never names the whole config)."""

TRANSLATORS = ("zerokit.planner",)
"""Beside the engine, not below it: the planner translates DeepSpeed configs to and from other frameworks' (through
config/dsconfig/) and names dtypes as DeepSpeed's blocks do (bf16, fp16)."""


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    """`module` is one of `prefixes` or inside one of those packages (a package of FACES_ONLY names its face only)."""
    return any(module == prefix or (prefix not in FACES_ONLY and module.startswith(prefix + "."))
               for prefix in prefixes)


def _rooms_below_the_engine() -> dict[str, Path]:
    return {module: path for module, path in _modules().items()
            if not _within(module, ABOVE_THE_ENGINE) and not _within(module, THE_CONFIG)}


def _names_in_code(tree: ast.AST) -> set[str]:
    """Every name the code uses (imports, names, attributes, string annotations), not what strings say."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rpartition(".")[2])
        annotation = getattr(node, "annotation", None) or getattr(node, "returns", None)
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            names |= _names_in_code(ast.parse(annotation.value, mode="eval"))
    return names


def test_no_room_below_the_engine_names_the_whole_config() -> None:
    """Each room below the engine is built with its own part of the run's settings (config/settings.py), never the
    whole ZeroConfig (See [Note: each room gets its part] in zerokit/config/settings.py)."""
    rooms = _rooms_below_the_engine()
    assert {"zerokit.config.settings", "zerokit.stages.base", "zerokit.checkpoint.save", "zerokit.tiers.placement",
            "zerokit.reliability.safeguards", "zerokit.observe.monitor", "zerokit.parallel.tensor.setup",
            "zerokit.engine.step"} <= set(rooms)
    assert not {"zerokit.engine.engine", "zerokit.config.typed", "zerokit.config.dsconfig.reader"} & set(rooms)
    naming = sorted(module for module, path in rooms.items()
                    if "ZeroConfig" in _names_in_code(ast.parse(path.read_text())))
    assert naming == []


def _typed_fields() -> set[str]:
    """ZeroConfig's field names, read from config/typed.py (a checkpoint's manifest records the config by them)."""
    tree = ast.parse((PACKAGE / "config" / "typed.py").read_text())
    config = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ZeroConfig")
    return {node.target.id for node in config.body if isinstance(node, ast.AnnAssign)}


def _deepspeed_keys() -> set[str]:
    """DeepSpeed's nested keys and its blocks, from the reader's schema (torch-free; the one import of this file), less
    the names a typed field shares with a block (`scheduler`, `optimizer`)."""
    from zerokit.config.dsconfig.schema import SCHEMA

    blocks = {path.partition(".")[0] for path in SCHEMA if "." in path}
    return ({path for path in SCHEMA if "." in path} | blocks) - _typed_fields()


def _raw_key_reads(tree: ast.AST, keys: set[str]) -> list[str]:
    """`x.get("<DeepSpeed key>")`, `x["<DeepSpeed key>"]` (a dotted key, or a block such as zero_optimization) and
    `<config>.source` (the DeepSpeed dict a ZeroConfig was read from)."""
    found = []
    for node in ast.walk(tree):
        key = None
        is_get = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
        if is_get and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Subscript):
            key = node.slice
        if isinstance(key, ast.Constant) and key.value in keys:
            found.append(f"line {node.lineno}: {key.value}")
        if isinstance(node, ast.Attribute) and node.attr == "source" and "config" in ast.unparse(node.value):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_room_below_the_engine_reads_a_deepspeed_key() -> None:
    """DeepSpeed's keys are read in config/dsconfig/ and turned into typed fields in config/typed.py; a room that read
    one from the dict (checkpoint/save.py once read checkpoint.tag_validation so) would miss a typed config's value."""
    keys = _deepspeed_keys()
    assert {"checkpoint.tag_validation", "zero_optimization"} <= keys
    rooms = {module: path for module, path in _rooms_below_the_engine().items() if not _within(module, TRANSLATORS)}
    reads = {module: found for module, path in rooms.items()
             if (found := _raw_key_reads(ast.parse(path.read_text()), keys))}
    assert reads == {}


def test_the_key_reading_sees_a_raw_read() -> None:
    tree = ast.parse('mode = engine.config.source.get("checkpoint.tag_validation")\nstage = d["zero_optimization"]\n'
                     'ok = manifest.config["gradient_accumulation_steps"]')
    assert sorted(_raw_key_reads(tree, {"checkpoint.tag_validation", "zero_optimization"})) == [
        "line 1: checkpoint.tag_validation", "line 1: engine.config.source", "line 2: zero_optimization"]
    assert "ZeroConfig" in _names_in_code(ast.parse("def f(c: 'ZeroConfig') -> None: ..."))
