"""`deepspeed.utils` for zerokit: the logger and log_dist that scripts import from it; its modules logging,
groups and zero_to_fp32 are what transformers, accelerate and Lightning import.

`logger` is zerokit's logger (`zerokit`, configured on first use: rank in every line); `log_dist` logs on the
given ranks only, as DeepSpeed's does.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch.distributed as dist

from zerokit._support.log import configure_logging, logger


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the ranks listed (None or [-1]: every rank)."""
    configure_logging()
    rank = dist.get_rank() if dist.is_initialized() else 0
    wanted = list(ranks) if ranks is not None else [-1]
    if -1 in wanted or rank in wanted:
        logger.log(level, message)


def set_z3_leaf_modules(model: Any, leaf_module_classes: list[Any]) -> list[Any]:
    """DeepSpeed marks these modules' parameters to be gathered whole at stage 3 (MoE experts a router skips);
    zerokit's stage 3 gathers each unit whole and names its units from the config, before the model is wrapped."""
    raise ValueError("deepspeed.utils.set_z3_leaf_modules is not offered: name the classes to gather whole in the "
                     "config instead, zero_optimization.stage3_unit_classes")


class RepeatingLoader:
    """DeepSpeed's: iterate a loader for ever, starting it again when it ends (pipeline scripts' train_batch
    iterators)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


__all__ = ["logger", "log_dist", "set_z3_leaf_modules", "RepeatingLoader"]
