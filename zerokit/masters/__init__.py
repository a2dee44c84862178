"""The optimizer side of a step: fp32 master weights, their gradients, and the optimizer over them."""

from zerokit.masters.device import DeviceMasters, copy_edits
from zerokit.masters.optimizer import rebuild_optimizer, trainable_groups

__all__ = ["DeviceMasters", "copy_edits", "rebuild_optimizer", "trainable_groups"]
