"""DeepSpeed's legacy offload switches, read as the blocks that replaced them.

`cpu_offload: true` is `offload_optimizer: {"device": "cpu"}`, `cpu_offload_param: true` is
`offload_param: {"device": "cpu"}`, and `cpu_offload_use_pin_memory` was their pin_memory. They are applied
after the whole config is read, since the block they stand for may come later in the file; giving a legacy
switch and its block together is refused, as DeepSpeed refuses it.
"""

from __future__ import annotations

from typing import Any

Z = "zero_optimization."
SWITCHES = {"cpu_offload": Z + "offload_optimizer", "cpu_offload_param": Z + "offload_param"}


def apply_legacy(state: Any) -> None:
    """`state` is the reader's _State: values, spelled, notes and legacy (name -> (value, spelling))."""
    turned_on = []
    for name, block in SWITCHES.items():
        if name not in state.legacy:
            continue
        on, spelled = state.legacy[name]
        given = [path for path in state.values if path.startswith(block + ".")]
        if given:
            raise ValueError(f"{spelled} and {state.spelled[given[0]].rpartition('.')[0]} both set "
                             f"{block.removeprefix(Z)}; keep {block.removeprefix(Z)} (the legacy key's "
                             "replacement)")
        if on:
            state.store(block + ".device", "cpu", spelled)
            turned_on.append(block)
        state.notes.append(f"{spelled}={'true' if on else 'false'}: read as "
                           f"{block.removeprefix(Z)}.device={'cpu' if on else 'none'}")
    _pin_memory(state, turned_on)


def _pin_memory(state: Any, turned_on: list[str]) -> None:
    if "cpu_offload_use_pin_memory" not in state.legacy:
        return
    pin, spelled = state.legacy["cpu_offload_use_pin_memory"]
    for block in turned_on:
        state.store(block + ".pin_memory", pin, spelled)
    where = " and ".join(block.removeprefix(Z) for block in turned_on)
    state.notes.append(f"{spelled}={'true' if pin else 'false'}: " + (
        f"read as {where}.pin_memory" if turned_on else "no effect without cpu_offload or cpu_offload_param "
                                                        "(DeepSpeed 0.19.8 ignores it too)"))
