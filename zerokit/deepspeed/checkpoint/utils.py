"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: what accelerate's get_state_dict uses at stages 0-2."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """A copy of `item` with every tensor in it (nested in lists, tuples and dicts) cloned onto `device`, so that
    saving it writes no storage shared with the live model (DeepSpeed's function, same result)."""
    device = torch.device(device)
    if torch.is_tensor(item):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(value, device) for value in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(value, device) for value in item)
    if isinstance(item, dict):
        return type(item)({key: clone_tensors_for_torch_save(value, device) for key, value in item.items()})
    return item


__all__ = ["clone_tensors_for_torch_save"]
