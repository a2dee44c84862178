"""Every package the tree imports is declared in pyproject.toml: the core ones as dependencies, the others in the
extra zerokit/_support/extras.py names for them, and imported only inside the function that needs them, so that a fresh
machine with the core dependencies alone imports every zerokit module. (A machine that happens to have a package
installed hides a missing declaration from the tests that use it: this reads the source instead.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerokit._support import extras

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OWN = {"zerokit", "benchmarks", "tests", "conftest", "common", "__future__"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


# Import names whose distribution is named otherwise: each extra then also allows the name its package imports as.
IMPORTED_AS = {"pytest-xdist": "xdist"}
CORE = _names(PYPROJECT["project"]["dependencies"])
EXTRAS = {extra: (names := _names(packages)) | {IMPORTED_AS[name] for name in names if name in IMPORTED_AS}
          for extra, packages in PYPROJECT["project"]["optional-dependencies"].items()}


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(top-level package, imported at module level, line) for every import of a file; a module-level `try:` around
    an import counts as module level (it still runs at import time)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name.split(".")[0], top, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], top, child.lineno))
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return [(name, top, line) for name, top, line in found if name not in sys.stdlib_module_names and name not in OWN]


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


OWN |= {path.stem for path in _files("tests")} | {path.stem for path in _files("benchmarks")}  # they import one another


def _refuses_import(path: Path) -> bool:
    """A module whose own top-level code raises ImportError on import: a deliberate one-line refusal (DeepSpeed's
    launcher, pipe and moe modules; a framework's integration without its extra: MissingExtra), or a command meant
    for `python -m` only."""
    def raises(body: list[ast.stmt]) -> bool:
        for statement in body:
            if isinstance(statement, ast.Raise) and isinstance(statement.exc, ast.Call) \
                    and getattr(statement.exc.func, "id", None) in ("ImportError", "MissingExtra"):
                return True
            if isinstance(statement, ast.If) and (raises(statement.body) or raises(statement.orelse)):
                return True
        return False
    return raises(ast.parse(path.read_text()).body)


def test_the_extras_table_and_pyproject_agree():
    for package, extra in extras.EXTRA_OF.items():
        assert package in EXTRAS.get(extra, set()), f"zerokit/_support/extras.py says {package} comes with [{extra}]"


def test_zerokit_imports_only_core_packages_at_module_level():
    """Except in a module that is an extra's feature (zerokit.integrations.lightning): it refuses its own import in
    one line naming the extra when the package is missing, and may then import it at its top."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in _files("zerokit")
             for name, top, line in _imports(path)
             if top and name not in CORE and not (name in extras.EXTRA_OF and _refuses_import(path))]
    assert not wrong, "declare these in [project] dependencies, or import them inside a function with extras.require"


def test_every_optional_package_zerokit_imports_has_its_extra():
    optional = {name for path in _files("zerokit") for name, _, _ in _imports(path)} - CORE
    undeclared = {name for name in optional if name not in EXTRAS.get(extras.EXTRA_OF.get(name, ""), set())}
    assert not undeclared, f"add each to an extra and to zerokit/_support/extras.py EXTRA_OF: {sorted(undeclared)}"


@pytest.mark.parametrize("folder,extra", [("tests", "test"), ("benchmarks", "bench")])
def test_tests_and_benchmarks_import_what_their_extra_declares(folder, extra):
    allowed = CORE | EXTRAS[extra] | EXTRAS["plot"] | EXTRAS["hf"] | ({"pytest"} if folder == "benchmarks" else set())
    trials = ROOT / "benchmarks" / "user_trial"  # a user trial may need the [trial] extra's venv of its own
    wrong = sorted({f"{path.relative_to(ROOT)} imports {name}" for path in _files(folder)
                    for name, _, _ in _imports(path)
                    if name not in allowed and not (path.is_relative_to(trials) and name in EXTRAS["trial"])})
    assert not wrong, f"declare these in the [{extra}] extra: {wrong}"


def test_a_missing_optional_package_is_one_line_naming_its_extra(monkeypatch):
    import importlib.util

    from zerokit.profiling import calibrate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(extras.MissingExtra) as error:
        calibrate.hf_config("gpt2")
    message = str(error.value)
    assert "\n" not in message and "transformers" in message and "pip install 'zerokit[hf]'" in message


def test_every_zerokit_module_imports_without_the_optional_packages():
    """In a fresh interpreter where every optional package fails to import, as on a machine with only the core
    dependencies: each module of zerokit still imports."""
    modules = sorted(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for path in _files("zerokit") if path.name != "__main__.py" and not _refuses_import(path))
    blocked = sorted(set(extras.EXTRA_OF) | {"pytest", "hypothesis"})
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, Block())
        for module in {modules!r}:
            importlib.import_module(module)
        print("imported", len({modules!r}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(modules)}" in done.stdout
