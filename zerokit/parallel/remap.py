"""Parameters replaced by pieces of them (tensor parallelism's splits, experts split over ranks), and the optimizer and
model_parameters a caller built over the whole model pointed at the pieces, as DeepSpeed remaps them after AutoTP's
replacement."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

Replacements = dict[int, "nn.Parameter | list[nn.Parameter]"]
"""id of a replaced parameter -> the piece (or pieces, in order) that replace it on this rank."""


def refuse_stepped_state(optimizer: Any, split_ids: set[int], what: str = "tensor parallelism splits") -> None:
    """An optimizer (or list of them) that has stepped a parameter being split already holds state of the whole shape,
    which no piece can take: refused."""
    for one in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        if not isinstance(one, torch.optim.Optimizer):
            continue
        stepped = [p for p in one.state if id(p) in split_ids and one.state[p]]
        if stepped:
            raise ValueError(f"the optimizer holds state for {len(stepped)} parameter(s) that {what}; build it (or "
                             "load its state) after the split, or pass a fresh one")


def remap_parameters(optimizer: Any, model_parameters: Iterable[Any] | None,
                     replaced: Replacements) -> tuple[Any, Iterable[Any] | None]:
    """An optimizer (or list of them) and model_parameters built over the whole model, made to name the pieces that
    replaced its split parameters: the optimizers' param groups in place, model_parameters (tensors, (name, tensor)
    pairs or param-group dicts) as a new list; a parameter replaced by several pieces is replaced by all of them, in
    place, a (name, tensor) pair by (name.i, piece i) (an optimizer that has stepped a split parameter is refused
    before: See refuse_stepped_state)."""
    def swap(param: Any) -> list[Any]:
        pieces = replaced.get(id(param), param)
        return list(pieces) if isinstance(pieces, list) else [pieces]

    for one in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        if not isinstance(one, torch.optim.Optimizer):
            continue
        for group in one.param_groups:
            group["params"] = [piece for p in group["params"] for piece in swap(p)]
    if model_parameters is None:
        return optimizer, None
    remapped: list[Any] = []
    for item in model_parameters:
        if isinstance(item, dict):
            remapped.append({**item, "params": [q for p in item["params"] for q in swap(p)]} if "params" in item
                            else item)
        elif isinstance(item, tuple) and len(item) == 2:
            pieces = swap(item[1])
            remapped += [(item[0], pieces[0])] if len(pieces) == 1 else [(f"{item[0]}.{i}", piece)
                                                                        for i, piece in enumerate(pieces)]
        else:
            remapped += swap(item)
    return optimizer, remapped
