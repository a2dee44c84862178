"""deepspeed.tp_model_init on zerokit, the call the Hugging Face Trainer makes when a DeepSpeed config has
`tensor_parallel.autotp_size` > 1 (transformers/integrations/deepspeed.py, deepspeed_init).

[Note: tp_model_init records, initialize splits]
In DeepSpeed 0.19.8 tp_model_init only records (tp_size, dtype) and returns the model untouched; the next
deepspeed.initialize merges them into the config's tensor_parallel block (conflicts are errors) and splits the model
there. The Trainer builds its optimizer between the two calls, over the whole model, and DeepSpeed remaps it onto the
pieces. zerokit does the same: the record waits here, initialize takes it (once: it is consumed, so a second engine
in the process is not split by an old call), and the engine splits the model and remaps the optimizer (See
zerokit/parallel/tensor/setup.py). A record is process state, as the API makes it; nothing else of the engine lives
here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_recorded: dict[str, Any] = {}

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any) -> nn.Module:
    """Record the tensor degree and dtype for the next deepspeed.initialize, which splits the model (See [Note:
    tp_model_init records, initialize splits]); returns `model` as it is. A tp_group of your own is refused: zerokit's
    layout makes the tensor group."""
    if kwargs.get("tp_group") is not None:
        raise ValueError("deepspeed.tp_model_init(tp_group=...) passes a tensor group of your own; zerokit's layout "
                         "makes the tensor group (consecutive ranks inside a node): leave tp_group out")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"deepspeed.tp_model_init(tp_size={tp_size!r}): the tensor degree must be a positive integer")
    previous = dict(_recorded)
    if previous and (previous["tp_size"], previous["dtype"]) != (tp_size, dtype):
        raise ValueError("Conflicting tp_model_init arguments detected across multiple calls.")
    _recorded.update(tp_size=tp_size, dtype=dtype)
    return model


def merge_recorded(given: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed dict with a recorded tp_model_init merged into its tensor_parallel block, as DeepSpeed 0.19.8
    merges it (runtime/tensor_parallel/init_utils.py): the config's values win where both agree, a conflict raises;
    the record is consumed. `given` unchanged where nothing was recorded."""
    if not _recorded:
        return given
    tp_size, dtype = _recorded.pop("tp_size"), _recorded.pop("dtype")
    block = dict(given.get("tensor_parallel") or {})
    configured = block.get("autotp_size")
    if configured is not None and configured != tp_size:
        raise ValueError(f"Conflicting tensor_parallel.autotp_size in config ({configured}) and tp_model_init "
                         f"({tp_size}).")
    block["autotp_size"] = tp_size
    config_dtype = _config_dtype(given)
    if config_dtype is not None and config_dtype != dtype:
        raise ValueError(f"Conflicting dtype: config uses {config_dtype} but tp_model_init requested {dtype}.")
    return {**given, "tensor_parallel": block}


def _config_dtype(given: dict[str, Any]) -> torch.dtype | None:
    """The compute dtype the config's precision blocks turn on (None where neither does, or "auto")."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        block = given.get(key)
        if isinstance(block, dict) and block.get("enabled") is True:
            return dtype
    return None
