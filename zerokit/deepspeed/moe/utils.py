"""`deepspeed.moe.utils` for zerokit: which parameters are experts' (is_moe_param), and the optimizer's parameter
groups split into dense and expert groups (split_params_into_different_moe_groups_for_optimizer), as DeepSpeed's MoE
scripts build them.

[Note: expert parameters are known by a registry]
DeepSpeed marks an expert's parameters by setting attributes on them (`allreduce = False`, `group_name`); zerokit
keeps the mark beside them instead, in a weak registry filled by the MoE layer that made them (layer.py), so a
parameter carries nothing it did not have. A parameter a script marked DeepSpeed's way is read as marked too.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

MAX_GROUP_SIZE = 178956971  # DeepSpeed's default cut of an expert group into optimizer groups (elements)
# id -> (a weak reference to the parameter, its expert group): by id, since tensors compare element by element (a
# WeakKeyDictionary would compare them); the reference tells a live parameter from one that reused a dead one's id
_EXPERT_GROUP_OF: dict[int, tuple[weakref.ref, str]] = {}


def mark_expert_parameters(module: nn.Module, group_name: str) -> None:
    """Record `module`'s parameters as experts' of the expert group `group_name` (See [Note: expert parameters are
    known by a registry])."""
    for param in module.parameters():
        _EXPERT_GROUP_OF[id(param)] = (weakref.ref(param, _forget(id(param))), group_name)


def _forget(key: int):
    return lambda _: _EXPERT_GROUP_OF.pop(key, None)


def expert_group_name(param: torch.Tensor) -> str | None:
    """The expert group of an expert's parameter; None for any other."""
    reference, name = _EXPERT_GROUP_OF.get(id(param), (None, None))
    if reference is not None and reference() is param:
        return name
    if getattr(param, "allreduce", True) is False:  # marked DeepSpeed's way
        return getattr(param, "group_name", None)
    return None


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's: whether `param` belongs to an expert."""
    return expert_group_name(param) is not None


def has_moe_layers(module: nn.Module) -> tuple[bool, int]:
    """DeepSpeed's: whether `module` holds MoE layers, and the experts of the last one found. A layer is known by
    DeepSpeed's attributes (layer.py's MoE imports this module, so this one does not import it)."""
    layers = [each for each in module.modules() if hasattr(each, "deepspeed_moe") and hasattr(each, "num_experts")]
    return bool(layers), layers[-1].num_experts if layers else 0


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                         max_group_size: int | float | None = MAX_GROUP_SIZE,
                                                         ) -> list[dict[str, Any]]:
    """DeepSpeed's: each group's expert parameters moved into groups of their own, one per expert group, marked
    `moe: True` and named by it, with the group's other settings, cut into groups of at most `max_group_size`
    elements (None: uncut); the dense ones left where they were. Groups need a `name`, as DeepSpeed's do."""
    groups = _as_group_list(param_groups)
    experts: dict[tuple[int, str], dict[str, Any]] = {}
    for index, group in enumerate(groups):
        if "name" not in group:
            raise ValueError("split_params_into_different_moe_groups_for_optimizer needs every parameter group to have "
                             "a 'name' (DeepSpeed's scripts give e.g. {'params': ..., 'name': 'parameters'})")
        dense = []
        for param in group["params"]:
            name = expert_group_name(param)
            if name is None:
                dense.append(param)
            else:
                experts.setdefault((index, name), {**group, "name": name, "moe": True, "params": []})["params"].append(
                    param)
        group["params"] = dense
    for expert_group in experts.values():
        groups.extend(_cut(expert_group, max_group_size))
    return groups


def _as_group_list(param_groups: Any) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise ValueError(f"param_groups must be a dict, or a list or tuple of dicts, got {type(param_groups).__name__}")


def _cut(group: dict[str, Any], max_group_size: int | float | None) -> list[dict[str, Any]]:
    """`group` as DeepSpeed cuts it: consecutive parameters while their elements stay within max_group_size."""
    if max_group_size is None:
        return [group]
    pieces: list[list[torch.Tensor]] = []
    size = 0
    for param in group["params"]:
        if not pieces or size + param.numel() > max_group_size:
            pieces.append([])
            size = 0
        pieces[-1].append(param)
        size += param.numel()
    return [{**group, "params": piece} for piece in pieces]


__all__ = ["is_moe_param", "has_moe_layers", "split_params_into_different_moe_groups_for_optimizer"]
