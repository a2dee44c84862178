"""Read a DeepSpeed config dict into canonical, coerced values: `read(raw) -> DeepSpeedConfig`.

Each key is looked up in the schema: a misspelt one is refused with the closest accepted key, a removed or
refused one in one line saying what it asks for and why zerokit does not offer it, an alias is stored under
the key it spells, and every value is read as DeepSpeed reads it (See [Note: reading JSON values] in
values.py). `_`-prefixed keys are comments. "auto" stays the AUTO marker until auto.resolve fills it in.

[Note: keys DeepSpeed reads at one stage only, and keys it ignores]
DeepSpeed reads the stage-3 keys (stage3_*, offload_param) only at stage 3 and ignores them below it; it
ignores top-level keys it does not know (LLaMA-Factory's templates carry "comms_config" and "monitor_config",
which no DeepSpeed version reads), while its pydantic sections refuse unknown keys inside them. zerokit reads
a config the same way, so that every config DeepSpeed trains with trains here: a stage-3 key below stage 3 is
dropped with a start-up line saying it is not used at that stage; an unknown top-level key is ignored with a
warning, unless it is a typo of a known key (one or two edits away), which is refused naming that key, since
a misspelt knob silently ignored is how a run trains differently from what its author wrote; an unknown key
inside a block is refused, as DeepSpeed refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import zerokit.config.dsconfig.values as v
from zerokit.config.dsconfig.keys import Key, KeyClass, Kind
from zerokit.config.dsconfig.legacy import apply_legacy
from zerokit.config.dsconfig.optim import read_typed_block
from zerokit.config.dsconfig.schema import SCHEMA, children
from zerokit.config.dsconfig.schema_zero import ZERO_REMOVED_ISSUE

DOCS = "docs/deepspeed_config.md"
STAGE = "zero_optimization.stage"
STEPS_PER_PRINT = "steps_per_print"
OFFLOAD_PARAM = "zero_optimization.offload_param"
OFFLOAD_OPTIMIZER = "zero_optimization.offload_optimizer"
UNSET = object()


@dataclass(frozen=True)
class Refusal:
    path: str
    value: Any
    message: str
    """One line: the key, what it asks for, why zerokit does not offer it."""


@dataclass(frozen=True)
class DeepSpeedConfig:
    """What a DeepSpeed config says, in zerokit's terms: canonical leaf paths to coerced values."""

    values: Mapping[str, Any]
    """Leaf path (aliases resolved) -> value; AUTO where "auto" was given. Only keys that were given."""
    spelled: Mapping[str, str] = field(default_factory=dict)
    """Leaf path -> the path as written (an alias's own spelling), for messages."""
    notes: tuple[str, ...] = ()
    """Start-up log lines: keys accepted because zerokit always does that, aliases read as their key."""
    refusals: tuple[Refusal, ...] = ()
    """With read(..., refuse=False): what would have been refused."""
    warnings: tuple[str, ...] = ()
    """Start-up warnings: keys ignored, as DeepSpeed ignores them (See [Note: keys DeepSpeed reads at one stage
    only, and keys it ignores])."""

    def given(self, path: str) -> bool:
        return path in self.values

    def get(self, path: str, fallback: Any = UNSET) -> Any:
        """The value given, else `fallback`, else DeepSpeed's default for the key."""
        if path in self.values:
            return self.values[path]
        if fallback is not UNSET:
            return fallback
        return SCHEMA[path].default if path in SCHEMA else None

    def under(self, prefix: str) -> dict[str, Any]:
        """The given leaves under a block, by their path relative to it."""
        start = prefix + "."
        return {path[len(start):]: value for path, value in self.values.items() if path.startswith(start)}

    def auto_paths(self) -> tuple[str, ...]:
        return tuple(path for path, value in self.values.items() if value is v.AUTO)

    def spelling(self, path: str) -> str:
        return self.spelled.get(path, path)

    def with_values(self, updates: Mapping[str, Any], drop: tuple[str, ...] = ()) -> DeepSpeedConfig:
        merged = {path: value for path, value in self.values.items() if path not in drop}
        merged.update(updates)
        return DeepSpeedConfig(MappingProxyType(merged), self.spelled, self.notes, self.refusals, self.warnings)


class _State:
    """What a read collects; refusals raise at once unless the caller asked to collect them."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.values: dict[str, Any] = {}
        self.spelled: dict[str, str] = {}
        self.notes: list[str] = []
        self.warnings: list[str] = []
        self.refusals: list[Refusal] = []
        self.legacy: dict[str, tuple[bool, str]] = {}
        """Legacy cpu_offload* switches: name -> (value, spelling), applied once the whole config is read."""

    def store(self, path: str, value: Any, spelled: str) -> None:
        if path in self.values:
            raise ValueError(f"{spelled} and {self.spelled[path]} are two spellings of one key; keep one")
        self.values[path] = value
        self.spelled[path] = spelled

    def refusal(self, path: str, value: Any, message: str) -> None:
        if self.refuse:
            raise ValueError(message)
        self.refusals.append(Refusal(path, value, message))


def read(raw: Mapping[str, Any], *, refuse: bool = True) -> DeepSpeedConfig:
    """Read a DeepSpeed-style dict. refuse=False collects refusals in `.refusals` instead of raising (the
    translator reports them); unknown keys, bad values and removed keys raise either way."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"a DeepSpeed config must be a JSON object, not {type(raw).__name__}")
    state = _State(refuse)
    read_block(raw, "", children(""), state)
    apply_legacy(state)
    _drop_keys_unused_at_the_stage(state)
    return DeepSpeedConfig(MappingProxyType(state.values), MappingProxyType(state.spelled), tuple(state.notes),
                           tuple(state.refusals), tuple(state.warnings))


def read_block(raw: Mapping[str, Any], prefix: str, table: Mapping[str, Key], state: _State,
               spelled_prefix: str | None = None) -> None:
    """Read one JSON object against the keys that may appear in it."""
    written = prefix if spelled_prefix is None else spelled_prefix
    for name, value in raw.items():
        if not isinstance(name, str):
            raise ValueError(f"config key {name!r} under {prefix.rstrip('.') or 'the top level'} is not a string")
        if name.startswith("_"):  # a comment, as in DeepSpeed's own examples ("_comment", "_read_the_docs")
            continue
        key = table.get(name)
        if key is None and not prefix and v.typo_of(name, table) is None:
            state.warnings.append(f"unknown top-level key {name!r}: ignored, as DeepSpeed 0.19.8 ignores it")
            continue
        if key is None:
            raise ValueError(unknown_key_message(prefix, name, table))
        _read_entry(key, value, written + name, state)


def unknown_key_message(prefix: str, name: str, table: Mapping[str, Key]) -> str:
    section = prefix.rstrip(".") or "top-level"
    guess = v.closest(name, table) if prefix else v.typo_of(name, table)
    if guess:
        return f"unknown {section} key {name!r}; did you mean {guess}?"
    names = sorted(key for key, entry in table.items() if entry.klass != KeyClass.REMOVED)
    listed = ", ".join(names) if len(names) <= 30 else f"see {DOCS} for every key"
    return f"unknown {section} key {name!r}; accepted: {listed}"


def _read_entry(key: Key, raw: Any, spelled: str, state: _State) -> None:
    if key.klass == KeyClass.REMOVED:
        raise ValueError(f"{spelled} was removed in DeepSpeed 0.19.8 ({ZERO_REMOVED_ISSUE}): it asked for "
                         f"{key.note}, which zerokit does not offer either")
    if raw is None and not key.nullable:
        return  # null: not set, DeepSpeed's default
    if raw is None:
        state.store(key.path, None, spelled)  # null is a value of its own here (output_file: the log)
        return
    if key.kind == Kind.BLOCK:
        _read_block_entry(key, raw, spelled, state)
        return
    value = coerce(key, raw, spelled)
    handler: Callable[[Key, Any, str, _State], None] = _HANDLERS[key.klass]
    handler(key, value, spelled, state)


def _read_block_entry(key: Key, raw: Any, spelled: str, state: _State) -> None:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{spelled} must be a JSON object, not {raw!r}")
    if key.klass == KeyClass.REFUSED:
        if _block_asks(key, raw, spelled):
            state.refusal(key.path, dict(raw), f"{spelled} asks for {key.note}, which zerokit does not offer: "
                                               f"{key.why}")
        return
    if key.klass == KeyClass.ALWAYS:  # a block that only tunes speed or memory: accepted whole, named
        if any(not str(name).startswith("_") for name in raw):
            state.notes.append(f"{spelled}: accepted, {key.note}")
        return
    if key.path in ("optimizer", "scheduler"):
        read_typed_block(key.path, raw, state, read_block)
        return
    target = key.alias_of or key.path
    if key.alias_of:
        state.notes.append(f"{spelled}: read as {target}")
    read_block(raw, target + ".", children(target), state, spelled + ".")


def _block_asks(key: Key, raw: Mapping[str, Any], spelled: str) -> bool:
    """Whether a refused block turns its feature on: any content, or its switch key."""
    content = {name: value for name, value in raw.items() if not str(name).startswith("_")}
    if not key.switch:
        return bool(content)
    switch = content.get(key.switch)
    if switch is None or v.is_auto(switch):
        return False
    if key.switch == "autotp_size":  # a tensor-parallel degree: 0 and 1 mean none
        return v.to_int(switch, f"{spelled}.{key.switch}") > 1
    return v.to_bool(switch, f"{spelled}.{key.switch}")


def coerce(key: Key, raw: Any, spelled: str) -> Any:
    """One value read as its kind; "auto" becomes AUTO where the key accepts it."""
    if key.path == STAGE:
        return _stage(raw)
    if key.path == STEPS_PER_PRINT and v.is_infinity(raw):
        return None  # accelerate writes float("inf") to silence DeepSpeed's step lines: never print
    if v.is_auto(raw):
        if not key.auto:
            raise ValueError(f"{spelled}='auto' is not accepted: zerokit does not choose this; write the value")
        return v.AUTO
    readers: dict[Kind, Callable[[Any, str], Any]] = {
        Kind.BOOL: v.to_bool, Kind.INT: v.to_int, Kind.FLOAT: v.to_float, Kind.STR: v.to_str,
        Kind.DTYPE: v.to_dtype, Kind.NAMES: v.to_names, Kind.PAIR: v.to_float_pair, Kind.FLOATS: v.to_float_or_list,
    }
    if key.kind == Kind.CHOICE:
        return v.to_choice(raw, spelled, key.choices)
    if key.kind in readers:
        return readers[key.kind](raw, spelled)
    return tuple(raw) if isinstance(raw, list) else raw


def _honoured(key: Key, value: Any, spelled: str, state: _State) -> None:
    state.store(key.path, value, spelled)


def _always(key: Key, value: Any, spelled: str, state: _State) -> None:
    if key.accepts and value is not v.AUTO and value not in key.accepts:
        state.refusal(key.path, value, f"{spelled}={v.show(value)} is not supported; {key.why}")
        return
    state.store(key.path, value, spelled)
    state.notes.append(f"{spelled}={v.show(value)}: accepted, {key.note}")


def _refused(key: Key, value: Any, spelled: str, state: _State) -> None:
    if value is v.AUTO or value in key.accepts:
        state.store(key.path, value, spelled)
        return
    state.refusal(key.path, value, f"{spelled}={v.show(value)} asks for {key.note}, which zerokit does not "
                                   f"offer: {key.why}")


def _alias(key: Key, value: Any, spelled: str, state: _State) -> None:
    if key.name.startswith("cpu_offload"):  # legacy switches that turn blocks on; applied after the read
        state.legacy[key.name] = (value, spelled)
        return
    state.notes.append(f"{spelled}: read as {key.alias_of}")
    state.store(key.alias_of, value, spelled)


_HANDLERS = {KeyClass.HONOURED: _honoured, KeyClass.ZEROKIT: _honoured, KeyClass.ALWAYS: _always,
             KeyClass.REFUSED: _refused, KeyClass.ALIAS: _alias}


def _stage(raw: Any) -> int:
    if v.is_auto(raw):
        raise ValueError("zero_optimization.stage='auto' is not accepted: zerokit does not choose the stage; write "
                         "0-3 (`zerokit plan` recommends one)")
    try:
        value = None if isinstance(raw, bool) else v.to_int(raw, STAGE)
    except ValueError:
        value = None
    if value not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage={raw!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    return value


def _drop_keys_unused_at_the_stage(state: _State) -> None:
    """Below stage 3, DeepSpeed reads no stage-3 key and no offload_param block, and at stage 0 no offload_optimizer
    block either; neither does zerokit. Each is dropped with a start-up line (See [Note: keys DeepSpeed reads at
    one stage only, and keys it ignores])."""
    stage = state.values.get(STAGE, 0)
    if stage == 3:
        return
    for path in [path for path in state.values if path in SCHEMA and SCHEMA[path].stage3]:
        spelled = state.spelled[path]
        state.notes[:] = [note for note in state.notes if not note.startswith(spelled + "=")]  # not "accepted"
        state.notes.append(f"{spelled}={v.show(state.values.pop(path))}: not used at stage {stage} (DeepSpeed reads "
                           "it only at stage 3)")
    _drop_offload_block(state, OFFLOAD_PARAM, f"not used at stage {stage}, which keeps whole parameters on every "
                        "rank (DeepSpeed offloads parameters only at stage 3)")
    if stage == 0:
        _drop_offload_block(state, OFFLOAD_OPTIMIZER, "not used at stage 0, which keeps the whole optimizer state on "
                            "every rank (DeepSpeed offloads it only at stages 1-3, and ignores the block at stage 0)")


def _drop_offload_block(state: _State, block: str, why: str) -> None:
    """An offload block the stage does not read: removed, with a start-up line if it offloads anything."""
    device = state.values.get(block + ".device", "none")
    if device != "none":
        state.notes.append(f"{state.spelled[block + '.device']}={device}: {why}")
    for path in [path for path in state.values if path.startswith(block + ".")]:
        del state.values[path]
