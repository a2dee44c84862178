"""`deepspeed.runtime.utils` for zerokit: set_random_seed, which DeepSpeed's pipeline examples call, the partition
arithmetic of PipelineModule (zerokit/deepspeed/pipe.py), and move_to_device, which DeepSpeed's sequence-parallel
(ALST) tutorial calls on each batch."""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerokit.deepspeed.pipe import _set_random_seed as set_random_seed
from zerokit.deepspeed.pipe import partition_balanced, partition_uniform


def move_to_device(item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """DeepSpeed's: `item` (a tensor, or lists, tuples and dicts of them, nested) on `device`. With criterion_func, an
    item it accepts is moved in place (its .data replaced) and returned, as DeepSpeed does."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(each, device, criterion_func) for each in item)
    if isinstance(item, dict):
        return {key: move_to_device(value, device, criterion_func) for key, value in item.items()}
    return item.to(device)


__all__ = ["set_random_seed", "partition_balanced", "partition_uniform", "move_to_device"]
