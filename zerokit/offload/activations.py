"""Activation checkpointing and its offload: DeepSpeed's activation_checkpointing block.

[Note: checkpointed activations in host memory]
A checkpointed function keeps only its inputs through the forward pass and recomputes the rest in backward
(torch.utils.checkpoint, non-reentrant, which zerokit's hooks support). With cpu_checkpointing those inputs,
the activations at each checkpoint's boundary, are kept in host memory instead: the function is checkpointed
over host copies of its tensor inputs and moves them back to the device as its first operation, so the
only tensors the checkpoint holds are the host copies, and autograd carries gradients back through both
moves. On a machine whose device is the CPU the copies are the tensors themselves. partition_activations,
contiguous_memory_optimization and number_checkpoints are about splitting and packing checkpoints across
model-parallel ranks, which zerokit does not have: with one rank per model replica they change nothing, as
in DeepSpeed without model parallelism, and the start-up log says so.

zerokit's own `checkpoint_units` (stage 3) checkpoints every unit's forward, so that a model need not be
edited to be checkpointed; `checkpoint(function, *args)` does the same for a function the model calls,
as deepspeed.checkpointing.checkpoint does.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_map

from zerokit.comm import CommStats, Transfer
from zerokit.config import ActivationCheckpointing
from zerokit.runtime import logger

_settings = ActivationCheckpointing()
_stats: CommStats | None = None
_device = torch.device("cpu")


def configure(settings: ActivationCheckpointing, stats: CommStats | None = None,
              device: torch.device = torch.device("cpu")) -> list[str]:
    """What `checkpoint` does from now on (the engine calls this at initialize with its config's block and
    the device it computes on); returns lines for the start-up log."""
    global _settings, _stats, _device
    _settings, _stats, _device = settings, stats, device
    return startup_lines(settings)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, checkpointed (See [Note: checkpointed activations in host memory])."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    settings = _settings
    if settings.synchronize_checkpoint_boundary and torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter() if settings.profile else 0.0
    if settings.cpu_checkpointing:
        result = torch_checkpoint(_on_device(function), *_to_host(args), use_reentrant=False, **kwargs)
    else:
        result = torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
    if settings.profile:
        logger.info("checkpointed %s: forward %.3f ms", getattr(function, "__qualname__", function),
                    1000 * (time.perf_counter() - started))
    return result


def checkpoint_modules(modules: list[nn.Module]) -> None:
    """Every module's forward checkpointed from now on (stage 3's units, with checkpoint_units)."""
    for module in modules:
        module.forward = functools.partial(checkpoint, module.forward)


def startup_lines(settings: ActivationCheckpointing) -> list[str]:
    lines = []
    if settings.partition_activations or settings.contiguous_memory_optimization or settings.number_checkpoints:
        lines.append("activation_checkpointing.partition_activations/contiguous_memory_optimization/"
                     "number_checkpoints: nothing to partition with one rank per model replica (as in DeepSpeed "
                     "without model parallelism)")
    return lines


def _to_host(args: tuple[Any, ...]) -> tuple[Any, ...]:
    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            if _stats is not None:
                _stats.record(Transfer.DEVICE_TO_HOST, value)
            return value.to("cpu")
        return value
    return tree_map(move, args)


def _on_device(function: Callable[..., Any]) -> Callable[..., Any]:
    device = _device

    def run(*args: Any, **kwargs: Any) -> Any:
        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.device != device:
                if _stats is not None:
                    _stats.record(Transfer.HOST_TO_DEVICE, value)
                return value.to(device)
            return value
        return function(*tree_map(move, args), **kwargs)
    return run
