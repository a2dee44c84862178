"""Every `zerokit.` name the README and the docs show resolves: a module, or an attribute reached from one (the
docs once named zerokit.profiling.record_run while the package exported nothing of the kind)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
DOTTED = re.compile(r"(?<![\w/.-])zerokit(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"from (zerokit[\w.]*) import ([\w, ]+)")


def _names() -> list[tuple[str, str]]:
    found = {}
    for page in PAGES:
        text = page.read_text()
        imported = [f"{module}.{name.split()[0]}" for module, names in FROM_IMPORT.findall(text)
                    for name in names.split(",") if name.strip()]  # `comm as dist` names comm
        for name in [*DOTTED.findall(text), *imported]:
            found.setdefault(name, page.relative_to(ROOT).as_posix())
    return sorted(found.items())


def _resolve(name: str) -> object:
    """As Python reads `zerokit.a.b` after importing it: each part an attribute of what came before, else the
    submodule of that name (so `zerokit.deepspeed.install` is the function, not the command module)."""
    parts = name.split(".")
    value = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        if not hasattr(value, part):
            importlib.import_module(".".join(parts[:index + 1]))
        value = getattr(value, part)
    return value


def test_the_pages_name_some_zerokit_names():
    assert len(_names()) >= 20  # the pattern still finds what the pages show


@pytest.mark.parametrize("name,page", _names())
def test_each_name_the_pages_show_resolves(name, page):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{page} names {name}, which does not resolve: {error}")
