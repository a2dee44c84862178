"""The start-up lines: what a user sees once, on rank 0, when an engine is built."""

from __future__ import annotations

from zerokit._support.log import configure_logging, logger
from zerokit.stages.base import ZeroStage


def log_startup(stage: ZeroStage, config_lines: list[str], config_warnings: tuple[str, ...] = ()) -> None:
    """What a user should see once, on rank 0: the stage, its buckets, how they are reduced, the units, and
    what the config reader accepted, derived or resolved (INFO), and what it ignored (WARNING)."""
    configure_logging()
    if stage.global_rank == 0:
        for line in [*stage.describe(), *config_lines]:
            logger.info(line)
        for line in config_warnings:
            logger.warning(line)
