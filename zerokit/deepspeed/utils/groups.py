"""`deepspeed.utils.groups` for zerokit: one data-parallel group over every rank; the sequence-parallel groups where an
ALST script made them (UlyssesSPAttentionHF.register_with_transformers: See
zerokit/deepspeed/runtime/sequence_parallel), else a sequence degree of 1, as DeepSpeed answers without them; and the
expert groups of MoE layers split over ranks, named as DeepSpeed names them ("ep_size_<ep>"), once
deepspeed.initialize has made them (See [Note: the drop-in's expert degree] in zerokit/deepspeed/moe/layer.py)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

import zerokit.deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp
from zerokit.parallel.experts.share import expert_layers


def _get_data_parallel_group() -> Any:
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size()


def _get_data_parallel_rank() -> int:
    return dist.get_rank()


def _get_sequence_parallel_world_size() -> int:
    return parallel_state_sp.get_sequence_parallel_world_size() if parallel_state_sp.layout() else 1


def _get_sequence_parallel_rank() -> int:
    return parallel_state_sp.get_sequence_parallel_rank() if parallel_state_sp.layout() else 0


def _get_sequence_parallel_group() -> Any:
    if parallel_state_sp.layout() is None:
        raise ValueError("deepspeed.utils.groups has no sequence-parallel group: none was made (DeepSpeed's ALST "
                         "scripts make it with UlyssesSPAttentionHF.register_with_transformers)")
    return parallel_state_sp.get_sequence_parallel_group()


def _get_sequence_data_parallel_group() -> Any:
    return parallel_state_sp.get_sequence_data_parallel_group() if parallel_state_sp.layout() else dist.group.WORLD


# "ep_size_<ep>" -> (this rank's expert group, its expert-data group), as deepspeed.initialize made them
_EXPERT_GROUPS: dict[str, tuple[Any, Any]] = {}


def record_expert_groups(model: nn.Module, expert_data: Any) -> None:
    """After deepspeed.initialize: the expert groups its engine gave `model`'s split MoE layers, and `expert_data`
    (the engine's expert-data group, a torch process group), under DeepSpeed's group name."""
    for layer in expert_layers(model):
        if layer.ep > 1:
            _EXPERT_GROUPS[f"ep_size_{layer.ep}"] = (layer.group, expert_data)


def _expert_groups(group_name: str) -> tuple[Any, Any]:
    if group_name not in _EXPERT_GROUPS:
        raise KeyError(f"deepspeed.utils.groups has no expert group {group_name!r}; made so far: "
                       f"{sorted(_EXPERT_GROUPS) or 'none'} (deepspeed.initialize makes them for a model's MoE layers)")
    return _EXPERT_GROUPS[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    return _expert_groups(group_name)[0]


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _expert_groups(group_name)[1]


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: groups[0] for name, groups in _EXPERT_GROUPS.items()}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: groups[1] for name, groups in _EXPERT_GROUPS.items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return dist.get_rank(_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert group, as DeepSpeed answers."""
    return dist.get_process_group_ranks(_get_expert_parallel_group(group_name))[0]


def _get_max_expert_size() -> int:
    """The largest expert degree made (DeepSpeed's), 1 where none was."""
    return max((int(name.rsplit("_", 1)[1]) for name in _EXPERT_GROUPS), default=1)


__all__ = ["_get_data_parallel_group", "_get_data_parallel_world_size", "_get_data_parallel_rank",
           "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank", "_get_sequence_parallel_group",
           "_get_sequence_data_parallel_group", "record_expert_groups", "_get_expert_parallel_group",
           "_get_expert_data_parallel_group", "_get_expert_parallel_group_dict", "_get_expert_data_parallel_group_dict",
           "_get_expert_parallel_world_size", "_get_expert_data_parallel_world_size", "_get_expert_parallel_rank",
           "_get_expert_data_parallel_rank", "_get_expert_parallel_src_rank", "_get_max_expert_size"]
