"""`engine.config` as DeepSpeed's engine has it: the config dict given to initialize(), which frameworks read
with `.get` and `[...]` (transformers: `engine.config.get("zero_optimization", {}).get("stage")`).

[Note: engine.config is both configs]
zerokit's Engine reads its typed, resolved ZeroConfig as `self.config.<field>` throughout, and DeepSpeed's
callers read the JSON dict as `engine.config[...]`. EngineConfig is the typed config (a ZeroConfig, every field
and check the same) that also answers the mapping calls with the DeepSpeed dict as given (a path's JSON read
in), so neither side changes. Attribute names never collide: the mapping side is reached only through
get/[]/in/keys/items/values.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, Mapping

from zerokit.config.typed import ZeroConfig


def config_dict(source: Any) -> dict[str, Any]:
    """The DeepSpeed dict a config source stands for: a mapping as given, a JSON path read; {} for a ZeroConfig."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, Path)):
        return json.loads(Path(source).read_text())
    return {}


class EngineConfig(ZeroConfig):
    """A ZeroConfig that is also read as the DeepSpeed dict it came from. See [Note: engine.config is both
    configs]."""

    given: dict[str, Any]  # not a dataclass field: set by of(), {} when built another way (replace())

    @classmethod
    def of(cls, typed: ZeroConfig, given: dict[str, Any]) -> "EngineConfig":
        view = object.__new__(cls)
        for field in fields(ZeroConfig):
            object.__setattr__(view, field.name, getattr(typed, field.name))
        object.__setattr__(view, "given", given)
        return view

    def _mapping(self) -> dict[str, Any]:
        return self.__dict__.get("given", {})

    def get(self, key: str, default: Any = None) -> Any:
        return self._mapping().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self._mapping()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._mapping()

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping())

    def keys(self) -> Any:
        return self._mapping().keys()

    def items(self) -> Any:
        return self._mapping().items()

    def values(self) -> Any:
        return self._mapping().values()


__all__ = ["EngineConfig", "config_dict"]
