"""`deepspeed.runtime.sequence_parallel.parallel_state_sp` for zerokit: the mpu DeepSpeed's ALST scripts pass to
initialize(mpu=...), its groups those of the job's Layout with a sequence dimension (consecutive ranks per replica,
as DeepSpeed numbers them: See [Note: the sequence dimension] in zerokit/parallel/mesh.py)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerokit.parallel.mesh import Layout

_STATE: dict[str, Any] = {}


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the sequence groups and the sequence-data group (every rank: ZeRO's); every rank calls it, once."""
    if not dist.is_initialized():
        raise ValueError("initialize_sequence_parallel needs the process group: call deepspeed.init_distributed() "
                         "first")
    if _STATE:
        raise ValueError("the sequence-parallel groups are made already (initialize_sequence_parallel runs once)")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    layout = Layout.resolve(dist.get_world_size(), sequence=sequence_parallel_size)
    me = dist.get_rank()
    for ranks in layout.sequence_groups():
        group = dist.new_group(ranks)
        if me in ranks:
            _STATE["sequence"] = group
    _STATE["layout"] = layout
    _STATE["sequence_data"] = dist.new_group(list(range(layout.world_size)))


def layout() -> Layout | None:
    """The job's layout the groups were made from; None before initialize_sequence_parallel."""
    return _STATE.get("layout")


def _state(key: str) -> Any:
    if key not in _STATE:
        raise ValueError("the sequence-parallel groups are not made: call UlyssesSPAttentionHF."
                         "register_with_transformers(...) or initialize_sequence_parallel(...) first")
    return _STATE[key]


def get_sequence_parallel_group() -> Any:
    return _state("sequence")


def get_sequence_data_parallel_group() -> Any:
    return _state("sequence_data")


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_data_parallel_group())


__all__ = ["initialize_sequence_parallel", "get_sequence_parallel_group", "get_sequence_data_parallel_group",
           "get_sequence_parallel_world_size", "get_sequence_data_parallel_world_size", "get_sequence_parallel_rank",
           "get_sequence_data_parallel_rank"]
