"""`deepspeed.utils` for zerokit: the logger and log_dist that scripts import from it.

`logger` is zerokit's logger (`zerokit`, configured on first use: rank in every line); `log_dist` logs on the
given ranks only, as DeepSpeed's does.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch.distributed as dist

from zerokit.runtime import configure_logging

logger = logging.getLogger("zerokit")


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the ranks listed (None or [-1]: every rank)."""
    configure_logging()
    rank = dist.get_rank() if dist.is_initialized() else 0
    wanted = list(ranks) if ranks is not None else [-1]
    if -1 in wanted or rank in wanted:
        logger.log(level, message)


__all__ = ["logger", "log_dist"]
