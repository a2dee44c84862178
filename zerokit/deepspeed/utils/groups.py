"""`deepspeed.utils.groups` for zerokit: one data-parallel group over every rank, and no sequence parallelism
(transformers and accelerate import this module and ask for sequence-parallel groups only when they set one up,
which zerokit refuses at initialize: mpu=...)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _get_data_parallel_group() -> Any:
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size()


def _get_data_parallel_rank() -> int:
    return dist.get_rank()


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group() -> Any:
    raise ValueError("deepspeed.utils.groups has no sequence-parallel group under zerokit: it shards over all ranks "
                     "and does not offer sequence parallelism")


__all__ = ["_get_data_parallel_group", "_get_data_parallel_world_size", "_get_data_parallel_rank",
           "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank", "_get_sequence_parallel_group"]
