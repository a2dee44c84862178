"""Process group, device and logging: torchrun's environment, or one plain process."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import os
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zerokit.stages.base import ZeroStage

logger = logging.getLogger("zerokit")


def ensure_process_group() -> None:
    """Join the group torchrun describes (NCCL with CUDA, gloo on CPU), or make a 1-rank group of the
    same back-end so that a plain `python train.py` runs the same code path as a launched job. Either way the
    groups are left at exit if the script does not leave them (See `leave_process_groups_at_exit`)."""
    leave_process_groups_at_exit()
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one plain process on a GPU machine trains on its GPU too
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@functools.cache
def leave_process_groups_at_exit() -> None:
    """Many training scripts (DeepSpeed's examples among them) end without destroy_process_group(), and a
    gloo group still alive at interpreter exit can abort the process ("terminate called without an active
    exception": 3 of 30 two-rank torchrun runs of such a script here, 0 of 30 with this). So at exit, if the
    groups are still there, the engines (kept in reference cycles) are collected while their groups exist, and
    then the groups destroyed."""
    atexit.register(_leave_process_groups)


def _leave_process_groups() -> None:
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def default_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (a test's capture, a redirect made after
    start-up), never to a stream that has since been closed."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _RankFilter(logging.Filter):
    """Puts the rank into every record (`%(rank)s`), so that lines from many ranks can be told apart."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = dist.get_rank() if dist.is_initialized() else 0
        return True


def configure_logging() -> None:
    """The `zerokit` logger writes INFO and above to stderr as `[zerokit rank R] message`, unless the
    application configured it (gave it handlers) first; ZEROKIT_LOG_LEVEL changes the level."""
    if logger.handlers:
        return
    handler = _StderrHandler()
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("[zerokit rank %(rank)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("ZEROKIT_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


def log_startup(stage: "ZeroStage", config_lines: list[str], config_warnings: tuple[str, ...] = ()) -> None:
    """What a user should see once, on rank 0: the stage, its buckets, how they are reduced, the units, and
    what the config reader accepted, derived or resolved (INFO), and what it ignored (WARNING)."""
    configure_logging()
    if stage.rank == 0:
        for line in [*stage.describe(), *config_lines]:
            logger.info(line)
        for line in config_warnings:
            logger.warning(line)
