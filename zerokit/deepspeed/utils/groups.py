"""`deepspeed.utils.groups` for zerokit: one data-parallel group over every rank; the sequence-parallel groups where an
ALST script made them (UlyssesSPAttentionHF.register_with_transformers: See
zerokit/deepspeed/runtime/sequence_parallel), else a sequence degree of 1, as DeepSpeed answers without them."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import zerokit.deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp


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


__all__ = ["_get_data_parallel_group", "_get_data_parallel_world_size", "_get_data_parallel_rank",
           "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank", "_get_sequence_parallel_group",
           "_get_sequence_data_parallel_group"]
