"""What of an optimizer's state is per element, what is per parameter, and how each is written down.

[Note: per-element state and per-parameter scalars]
An element-wise optimizer (See [Note: element-wise and whole-tensor optimizers] in masters/optimizer.py)
keeps, per optimizer piece, tensors shaped like the piece (Adam's exp_avg, exp_avg_sq; SGD's
momentum_buffer) and scalars (`step`, a 0-dim tensor; ASGD's eta and mu) that are the same for every
piece of one parameter, since a parameter's pieces are stepped together. The tensors are saved element
by element, so any other cut of the parameter can read its own range back; the scalars once per
parameter, in the manifest. Anything else (a state tensor of another shape) cannot be cut by position
and is refused when saving rather than resumed wrong. A whole-tensor optimizer's state (Muon's momentum,
Adafactor's factored row and column variances) is saved whole, 0-dim tensors as scalars too.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerokit.checkpoint.manifest import dtype_name, dtype_of


def encode_scalar(value: Any, param_device: torch.device) -> dict[str, Any]:
    """A per-parameter state value (a 0-dim tensor, a number, None, ...) as JSON."""
    if isinstance(value, torch.Tensor):
        return {"tensor": dtype_name(value.dtype), "value": _number(value.item()),
                "on_param_device": value.device == param_device and value.device.type != "cpu"}
    if value is None or isinstance(value, (bool, int, str)):
        return {"value": value}
    if isinstance(value, float):
        return {"value": _number(value)}
    raise ValueError(f"optimizer state value of type {type(value).__name__} cannot be saved in a checkpoint")


def decode_scalar(encoded: dict[str, Any], param_device: torch.device) -> Any:
    value = _from_number(encoded["value"])
    if "tensor" not in encoded:
        return value
    device = param_device if encoded.get("on_param_device") else torch.device("cpu")
    return torch.tensor(value, dtype=dtype_of(encoded["tensor"]), device=device)


def _number(value: Any) -> Any:
    """JSON has no inf or nan: they are written as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def _from_number(value: Any) -> Any:
    return float(value) if value in ("inf", "-inf", "nan") else value


def split_piece_state(state: dict[str, Any], piece: torch.Tensor, whole_tensor: bool,
                      name: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """A piece's optimizer state as (tensors to save, encoded scalars). See [Note: per-element state and
    per-parameter scalars]."""
    tensors, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if not whole_tensor and value.shape != piece.shape:
                raise ValueError(f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, "
                                 f"neither one value per element ({tuple(piece.shape)}) nor a scalar: "
                                 "it cannot be saved by parameter part")
            tensors[key] = value.detach()
        else:
            scalars[key] = encode_scalar(value, piece.device)
    return tensors, scalars


def encode_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (an LR scheduler changes them), without the parameters."""
    return [encode_hyperparameters(group) for group in optimizer.param_groups]


def encode_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """One param group's hyperparameters as JSON (what restore_groups reads), without the parameters."""
    return {key: _encode_hyper(value) for key, value in group.items() if key != "params" and _savable(value)}


def restore_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]], where: str) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"{where}: the saved {type(optimizer).__name__} has {len(saved)} param groups, this one "
                         f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved):
        for key, encoded in values.items():
            value = _decode_hyper(encoded)
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple) and isinstance(value, list):
                group[key] = tuple(value)
            else:
                group[key] = value


def _savable(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    if isinstance(value, (list, tuple)):
        return all(_savable(item) and not isinstance(item, (list, tuple)) for item in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _encode_hyper(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _number(value.item())
    if isinstance(value, (list, tuple)):
        return [_encode_hyper(item) for item in value]
    return _number(value)


def _decode_hyper(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_hyper(item) for item in value]
    return _from_number(value)
