"""The masters' part of engine.state_dict(): their values and their pieces' optimizer state, on any tier (a
master paged to NVMe is paged in to be read or written; See ShardMasters.resident)."""

from __future__ import annotations

from typing import Any

import torch

from zerokit.masters.shards import ShardMasters


def masters_state_dict(masters: ShardMasters) -> dict[str, Any]:
    """Masters and optimizer state; a paged master's pieces' state under "paged_state", by piece position."""
    values, paged_state = [], {}
    optimizer_of = masters.optimizer_of()
    for index, master in enumerate(masters.masters):
        home = masters.homes[index]
        with masters.resident(index):
            # a paged master's tensor is its placeholder: its values are in the records paged in
            values.append(home.resident_values() if home.paged else master.detach())
            if home.paged:
                paged_state[index] = [_clone(optimizer_of[id(piece.param)].state.get(piece.param, {}))
                                      for piece in masters.pieces[index]]
    return {"masters": values, "optimizers": [optimizer.state_dict() for optimizer in masters.optimizers],
            "paged_state": paged_state}


def load_masters_state(masters: ShardMasters, state: dict[str, Any]) -> None:
    """The inverse of masters_state_dict, into masters of the same layout."""
    if len(state["masters"]) != len(masters.masters):
        raise ValueError(f"the saved optimizer state has {len(state['masters'])} masters, this layout "
                         f"{len(masters.masters)}")
    for optimizer, saved in zip(masters.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for index, (master, saved) in enumerate(zip(masters.masters, state["masters"])):
        with masters.resident(index), torch.no_grad():
            if masters.homes[index].paged:
                _load_paged(masters, index, saved, state.get("paged_state", {}).get(index, []))
            else:
                master.copy_(saved)


def _load_paged(masters: ShardMasters, index: int, saved: torch.Tensor, states: list[dict[str, Any]]) -> None:
    """Into a paged-in master: its values, and its pieces' state (written back on leaving `resident`)."""
    optimizer_of = masters.optimizer_of()
    for position, piece in enumerate(masters.pieces[index]):
        piece.param.copy_(saved[piece.offset:piece.offset + piece.param.numel()].view(piece.param.shape))
        if position < len(states) and states[position]:
            optimizer_of[id(piece.param)].state[piece.param] = _clone(states[position])


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
