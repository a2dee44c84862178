"""`deepspeed.utils.logging` for zerokit: its `logger` (zerokit's), which Lightning quiets with setLevel."""

from zerokit.deepspeed.utils import log_dist, logger

__all__ = ["logger", "log_dist"]
