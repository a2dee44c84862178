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

[Note: each engine checkpoints with its own settings]
An RLHF trainer runs an actor, a critic and a reference model in one process, each an engine with its own
activation_checkpointing block. So the settings, the device and the counters a host copy is recorded in
belong to an engine's `ActivationCheckpointer`, never to the module: a unit's forward is bound to its
engine's checkpointer when it is wrapped, and `checkpoint()`, which a model calls without naming an engine,
uses the checkpointer of the engine whose forward is running (the engine's `__call__` enters
`checkpointer.running()`); outside any engine's forward it checkpoints with the block's defaults.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_map

from zerokit._support.log import logger
from zerokit.comm import CommStats, Transfer
from zerokit.config.typed import ActivationCheckpointing


class ActivationCheckpointer:
    """One engine's activation checkpointing (See [Note: each engine checkpoints with its own settings]):
    its config block, the device it computes on, and its counters, where host copies are recorded."""

    def __init__(self, settings: ActivationCheckpointing = ActivationCheckpointing(), stats: CommStats | None = None,
                 device: torch.device = torch.device("cpu")) -> None:
        self.settings, self.stats, self.device = settings, stats, device

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)`, checkpointed (See [Note: checkpointed activations in host memory])."""
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        settings = self.settings
        if settings.synchronize_checkpoint_boundary and torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter() if settings.profile else 0.0
        if settings.cpu_checkpointing:
            result = torch_checkpoint(self._on_device(function), *self._to_host(args), use_reentrant=False, **kwargs)
        else:
            result = torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
        if settings.profile:
            logger.info("checkpointed %s: forward %.3f ms", getattr(function, "__qualname__", function),
                        1000 * (time.perf_counter() - started))
        return result

    def checkpoint_modules(self, modules: list[nn.Module]) -> None:
        """Every module's forward checkpointed by this checkpointer from now on (stage 3's units, with
        checkpoint_units)."""
        for module in modules:
            module.forward = functools.partial(self.checkpoint, module.forward)

    @contextmanager
    def running(self) -> Iterator[None]:
        """While open, `checkpoint()` is this checkpointer's: its engine's forward is running."""
        token = _RUNNING.set(self)
        try:
            yield
        finally:
            _RUNNING.reset(token)

    def startup_lines(self) -> list[str]:
        settings = self.settings
        if settings.partition_activations or settings.contiguous_memory_optimization or settings.number_checkpoints:
            return ["activation_checkpointing.partition_activations/contiguous_memory_optimization/"
                    "number_checkpoints: nothing to partition with one rank per model replica (as in DeepSpeed "
                    "without model parallelism)"]
        return []

    def _to_host(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                self._record(Transfer.DEVICE_TO_HOST, value)
                return value.to("cpu")
            return value
        return tree_map(move, args)

    def _on_device(self, function: Callable[..., Any]) -> Callable[..., Any]:
        device = self.device

        def run(*args: Any, **kwargs: Any) -> Any:
            def move(value: Any) -> Any:
                if isinstance(value, torch.Tensor) and value.device != device:
                    self._record(Transfer.HOST_TO_DEVICE, value)
                    return value.to(device)
                return value
            return function(*tree_map(move, args), **kwargs)
        return run

    def _record(self, transfer: Transfer, tensor: torch.Tensor) -> None:
        if self.stats is not None:
            self.stats.record(transfer, tensor)


# the checkpointer of the engine whose forward is running; outside any, the block's defaults
_RUNNING: ContextVar[ActivationCheckpointer] = ContextVar("zerokit_activation_checkpointer",
                                                          default=ActivationCheckpointer())


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, checkpointed by the running engine's checkpointer (See [Note: each engine
    checkpoints with its own settings]); what a model calls for a function of its own."""
    return _RUNNING.get().checkpoint(function, *args, **kwargs)
