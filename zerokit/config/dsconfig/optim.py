"""Reading the `optimizer` and `scheduler` blocks, whose params depend on their type."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import zerokit.config.dsconfig.values as v
from zerokit.config.dsconfig.schema import children
from zerokit.config.dsconfig.schema_optim import (OPTIMIZER_TYPES, OWN_SCHEDULE, REFUSED_OPTIMIZERS, REQUIRED_PARAMS,
                                           SCHEDULER_TYPES, canonical_type, params_table)

ReadBlock = Callable[..., None]


def read_typed_block(kind: str, raw: Mapping[str, Any], state: Any, read_block: ReadBlock) -> None:
    """Read `optimizer` or `scheduler`: its type first, then its params against that type's table."""
    rest = {name: value for name, value in raw.items() if not str(name).startswith("_")}
    type_raw, params = rest.pop("type", None), rest.pop("params", None)
    read_block(rest, kind + ".", children(kind), state)
    if type_raw is None:
        if params:
            raise ValueError(f"{kind}.params is given but {kind}.type is not; name the {kind}, like "
                             f"\"{'AdamW' if kind == 'optimizer' else 'WarmupLR'}\"")
        return
    type_name = _type(kind, type_raw, state)
    if type_name is None:
        return
    state.store(kind + ".type", type_name, kind + ".type")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{kind}.params must be a JSON object, not {params!r}")
    read_block(params, kind + ".params.", params_table(kind, type_name), state)
    for name in REQUIRED_PARAMS.get(type_name, ()) if kind == "scheduler" else ():
        if kind + ".params." + name not in state.values:
            raise ValueError(f"{kind}.params.{name} is required by {type_name}")


def _type(kind: str, raw: Any, state: Any) -> str | None:
    """The canonical type name, or None when a refused type was collected (refuse=False)."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"{kind}.type={raw!r} must be a name, like \"AdamW\"")
    name = canonical_type(kind, raw)
    accepted = OPTIMIZER_TYPES if kind == "optimizer" else SCHEDULER_TYPES
    if name in accepted:
        return name
    if kind == "optimizer" and name in REFUSED_OPTIMIZERS:
        state.refusal(kind + ".type", raw, f"optimizer.type={raw!r} asks for {REFUSED_OPTIMIZERS[name]}")
        return None
    guess = v.closest(name.lower(), [n.lower() for n in accepted])  # DeepSpeed ignores case in these names
    hint = f"did you mean {canonical_type(kind, guess)}? " if guess else ""
    instead = "pass a torch optimizer to initialize() instead" if kind == "optimizer" else OWN_SCHEDULE
    raise ValueError(f"{kind}.type={raw!r} is not one zerokit builds; {hint}zerokit builds {v.words(accepted)}; "
                     f"{instead}")
