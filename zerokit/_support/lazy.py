"""Names a package imports on first use, so that importing it (zerokit, zerokit.flat) does not pay for
importing torch where the caller needs only its pure-Python parts (`zerokit plan`, the planner)."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_names(package: str, table: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module-level __getattr__ for `package`: table[name] is the module that defines `name`, imported on
    first use and kept in the package's `namespace` from then on."""
    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(import_module(table[name]), name)
        return value
    return __getattr__


__all__ = ["lazy_names"]
