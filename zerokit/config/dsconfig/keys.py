"""What zerokit does with each key of a DeepSpeed config: the vocabulary of the schema.

Every key DeepSpeed 0.19.x documents or reads (docs/_pages/config-json.md, deepspeed/runtime/config.py,
runtime/zero/config.py, runtime/zero/offload_config.py, precision_config.py, monitor/config.py, ...) is one
`Key` in zerokit/config/dsconfig/schema_*.py, with one `KeyClass`. The reader (reader.py), the typed config
(zerokit/config/typed.py), the translator (planner/translate.py) and the table in docs/deepspeed_config.md all
read these entries, so what a key means is written once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class KeyClass(str, enum.Enum):
    HONOURED = "honoured"
    """Read with DeepSpeed's meaning."""
    ZEROKIT = "zerokit"
    """zerokit's own key (DeepSpeed has no such key)."""
    ALWAYS = "always"
    """Accepted because zerokit always does that (or has nothing to tune there); named in the start-up log.
    A value asking for the opposite of what zerokit does is refused with `why`."""
    REFUSED = "refused"
    """Asks for a feature zerokit does not offer: refused in one line, unless its value asks for nothing
    (DeepSpeed's default, `enabled: false`, 0, ...)."""
    REMOVED = "removed"
    """DeepSpeed 0.19.8 removed it (deepspeedai/DeepSpeed#8489): refused whenever present, as DeepSpeed does."""
    ALIAS = "alias"
    """A legacy or alternative spelling of another key, read as that key and named in the start-up log."""


class Kind(str, enum.Enum):
    """How a value is read (See [Note: reading JSON values] in values.py)."""

    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    STR = "str"
    DTYPE = "dtype"
    CHOICE = "choice"
    NAMES = "names"
    PAIR = "pair"
    FLOATS = "floats"
    BLOCK = "block"
    ANY = "any"


@dataclass(frozen=True)
class Key:
    path: str
    """Dotted path from the top of the config, e.g. "zero_optimization.offload_param.device"."""
    klass: KeyClass
    kind: Kind = Kind.ANY
    default: Any = None
    """DeepSpeed's default: what an absent key, a null and an accepted "auto" mean."""
    note: str = ""
    """HONOURED/ZEROKIT: what it does in zerokit. ALWAYS: what zerokit always does. REFUSED/REMOVED: what the
    key asks for. ALIAS: how it is read."""
    why: str = ""
    """REFUSED/REMOVED/ALWAYS: why zerokit does not offer what the value asks for."""
    accepts: tuple[Any, ...] = ()
    """ALWAYS and REFUSED leaves: the values accepted (those that ask for nothing zerokit lacks); empty: any."""
    alias_of: str = ""
    choices: tuple[str, ...] = ()
    stage3: bool = False
    """Only stage 3 reads it; given at another stage it would silently do nothing, so it is refused."""
    auto: bool = True
    """Whether "auto" is accepted ("zerokit decides")."""
    switch: str = ""
    """REFUSED blocks: the key inside that turns the block on; the block asks for nothing while it is off.
    Empty: any content asks."""
    nullable: bool = False
    """null is a value of its own here (a path not set), not "use the default"."""

    @property
    def parent(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


def honoured(path: str, kind: Kind, default: Any = None, note: str = "", **extra: Any) -> Key:
    return Key(path, KeyClass.HONOURED, kind, default, note, **extra)


def zerokit_key(path: str, kind: Kind, default: Any, note: str, **extra: Any) -> Key:
    return Key(path, KeyClass.ZEROKIT, kind, default, note, **extra)


def always(path: str, note: str, kind: Kind = Kind.ANY, default: Any = None, accepts: tuple[Any, ...] = (),
           why: str = "", **extra: Any) -> Key:
    return Key(path, KeyClass.ALWAYS, kind, default, note, why, accepts, **extra)


def refused(path: str, asks: str, why: str, kind: Kind = Kind.BOOL, default: Any = False,
            accepts: tuple[Any, ...] | None = None, **extra: Any) -> Key:
    """A leaf that asks for something unless it holds one of `accepts` (default: its default)."""
    return Key(path, KeyClass.REFUSED, kind, default, asks, why, (default,) if accepts is None else accepts, **extra)


def refused_block(path: str, asks: str, why: str, switch: str = "enabled") -> Key:
    return Key(path, KeyClass.REFUSED, Kind.BLOCK, None, asks, why, switch=switch)


def removed(path: str, asks: str) -> Key:
    return Key(path, KeyClass.REMOVED, Kind.ANY, None, asks, "DeepSpeed 0.19.8 removed it and zerokit does not "
               "offer it either")


def alias(path: str, of: str, kind: Kind, note: str = "", **extra: Any) -> Key:
    return Key(path, KeyClass.ALIAS, kind, None, note or f"read as {of}", alias_of=of, **extra)


def block(path: str, note: str, klass: KeyClass = KeyClass.HONOURED) -> Key:
    return Key(path, klass, Kind.BLOCK, None, note)
