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
    """Import the longest prefix that is a module, then follow attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as missing:
            if not ".".join(parts[:cut]).startswith(missing.name or "\0"):
                raise  # the module exists but imports something missing: a real failure
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(name)


def test_the_pages_name_some_zerokit_names():
    assert len(_names()) >= 20  # the pattern still finds what the pages show


@pytest.mark.parametrize("name,page", _names())
def test_each_name_the_pages_show_resolves(name, page):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{page} names {name}, which does not resolve: {error}")
