"""Every DeepSpeed key zerokit knows, in one table: `SCHEMA[path] -> Key`.

The entries live in schema_top.py (batch, training, precision, parallelism and removed features),
schema_zero.py (zero_optimization and its offload blocks), schema_blocks.py (observability, activation
checkpointing, checkpoints, I/O) and schema_optim.py (each optimizer and scheduler type's params, which
depend on the type and so sit in tables of their own).
"""

from __future__ import annotations

import zerokit.config.dsconfig.schema_blocks as schema_blocks
import zerokit.config.dsconfig.schema_top as schema_top
import zerokit.config.dsconfig.schema_zero as schema_zero
from zerokit.config.dsconfig.keys import Key, KeyClass, Kind
from zerokit.config.dsconfig.values import show
from zerokit.config.dsconfig.schema_optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS

ALL_KEYS: tuple[Key, ...] = (*schema_top.KEYS, *schema_zero.KEYS, *schema_blocks.KEYS)
SCHEMA: dict[str, Key] = {key.path: key for key in ALL_KEYS}
CHILDREN: dict[str, dict[str, Key]] = {}
for _key in ALL_KEYS:
    CHILDREN.setdefault(_key.parent, {})[_key.name] = _key
del _key


def children(path: str) -> dict[str, Key]:
    """The keys directly inside the block at `path` ("" is the top level)."""
    return CHILDREN.get(path, {})


def key_at(path: str) -> Key:
    """The entry for a path; raises KeyError for a path zerokit does not know."""
    return SCHEMA[path]


def default(path: str):
    """DeepSpeed's default for a key (what absent, null and an accepted "auto" mean)."""
    return SCHEMA[path].default


def rows() -> list[tuple[str, KeyClass, str]]:
    """(key, class, what zerokit does) for every key, the optimizer/scheduler params per type included,
    in the order of the schema modules: what docs/deepspeed_config.md lists."""
    out = [(key.path, key.klass, _describe(key)) for key in ALL_KEYS]
    for kind, tables in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        for type_name, table in tables.items():
            out += [(f"{kind}.params.{name} ({type_name})", key.klass, _describe(key)) for name, key in table.items()]
    return out


def _describe(key: Key) -> str:
    accepted = " or ".join(show(value) if value != () else "[]" for value in key.accepts)
    if key.klass == KeyClass.REFUSED and key.kind == Kind.BLOCK:
        off = f"accepted while {key.switch} is off" if key.switch else "accepted when empty"
        return f"asks for {key.note} ({off}): {key.why}"
    if key.klass == KeyClass.REFUSED:
        return f"asks for {key.note} (accepted: {accepted}): {key.why}"
    if key.klass == KeyClass.REMOVED:
        return f"asked for {key.note}: {key.why}"
    if key.klass == KeyClass.ALWAYS and key.accepts:
        return f"{key.note} (accepted: {accepted}; other values: {key.why})"
    return key.note
