"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: what accelerate's get_state_dict uses at stages 0-2."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """A copy of `item` with every tensor in it (nested in lists, tuples and dicts) cloned onto `device`, so that
    saving it writes no storage shared with the live model (DeepSpeed's function, same result). A model state dict
    holding experts split over ranks holds this rank's experts only, under its own names: refused in one line."""
    _refuse_split_experts(item)
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


def _refuse_split_experts(item: Any) -> None:
    from zerokit.parallel.experts.share import split_expert_storages
    if not isinstance(item, dict):
        return
    split = split_expert_storages()
    held = next((key for key, value in item.items() if torch.is_tensor(value) and value.data_ptr() in split), None)
    if held is not None:
        raise ValueError(f"clone_tensors_for_torch_save got a state dict holding {held!r}, an MoE expert split over "
                         "ranks: the model's own state_dict holds this rank's experts only; save the whole model with "
                         "engine.save_pretrained(dir) or engine.full_state_dict() on every rank (accelerate's "
                         "get_state_dict reads the model's state_dict below ZeRO-3)")


__all__ = ["clone_tensors_for_torch_save"]
