"""The `zerokit` logger, and how it writes when the application has not configured it. A leaf: it imports nothing of
zerokit, so the lowest rooms (comm/'s deadlines, the tiers) log through it without importing the runtime above
them."""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

logger = logging.getLogger("zerokit")


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
