"""`deepspeed.runtime.zero.partition_parameters` for zerokit: the names transformers reads and swaps around
zero.Init (to keep torch.arange's dtype while RoPE buffers are built), and ZeroParamStatus (TRL compares a
parameter's ds_status with it: See zerokit/deepspeed/zero3_params.py).

DeepSpeed's zero.Init wraps torch's tensor constructors with zero_wrapper_for_fp_tensor_constructor (each new
floating tensor made on the accelerator in the config's dtype). zerokit's zero.Init builds on the meta device
instead (See [Note: zero.Init is meta construction] in zerokit/deepspeed/zero.py) and wraps no constructor, so
swapping this function changes nothing there; it is kept with DeepSpeed's behaviour for callers that use it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerokit.deepspeed.accelerator import get_accelerator
from zerokit.deepspeed.zero import GatheredParameters, Init
from zerokit.deepspeed.zero3_params import ZeroParamStatus

_orig_torch_arange = torch.arange  # the constructor transformers tells apart (by identity)


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable:
    """`fn` (a torch tensor constructor) making its tensor on `target_device` (default: this rank's accelerator
    device), floating ones in `target_fp_dtype`, as DeepSpeed's wrapper does."""
    device = target_device if target_device is not None else torch.device(get_accelerator().current_device_name())

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped_fn


__all__ = ["zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange", "get_accelerator", "Init",
           "GatheredParameters", "ZeroParamStatus"]
