"""`deepspeed.checkpointing` for zerokit: activation checkpointing as torch's (use_reentrant=False), which zerokit
supports at every stage. Lightning calls configure() when its config has an `activation_checkpointing` block.

configure()'s settings only trade memory for speed (partition_activations, contiguous memory, CPU copies,
synchronisation, profiling): they are accepted and logged. checkpoint() recomputes as torch does, with the
activation_checkpointing block of the engine whose forward is running (See zerokit/engine/activations.py).
Model parallelism (mpu_) is refused, as everywhere in zerokit.
"""

from __future__ import annotations

from typing import Any, Callable

from zerokit.engine import activations
from zerokit._support.log import logger

_SETTINGS: dict[str, Any] = {}


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    if mpu_ is not None:
        raise ValueError("deepspeed.checkpointing.configure(mpu_=...) asks for model parallelism, which zerokit does "
                         "not offer")
    given = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu, "synchronize": synchronize,
             "profile": profile}
    _SETTINGS.update({key: value for key, value in given.items() if value is not None})
    chosen = {key: value for key, value in _SETTINGS.items() if value}
    if chosen:
        logger.info(f"deepspeed.checkpointing.configure: {chosen} only tune memory or speed; zerokit recomputes "
                    "activations with torch.utils.checkpoint (use_reentrant=False)")


def is_configured() -> bool:
    return bool(_SETTINGS)


def checkpoint(function: Callable, *args: Any) -> Any:
    """Run `function(*args)` without keeping its activations; backward recomputes them, with the
    activation_checkpointing block of the engine whose forward is running (its cpu_checkpointing, profile)."""
    return activations.checkpoint(function, *args)


__all__ = ["configure", "is_configured", "checkpoint"]
