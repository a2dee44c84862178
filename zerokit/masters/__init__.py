"""The optimizer side of a step: fp32 master weights, their gradients, and the optimizers over them."""

from zerokit.masters.device import DeviceMasters, OptimizerPlan, PieceRef, copy_edits
from zerokit.masters.optimizer import GroupRef, optimizer_kind, rebuild_optimizer, trainable_groups

__all__ = ["DeviceMasters", "GroupRef", "OptimizerPlan", "PieceRef", "copy_edits", "optimizer_kind", "rebuild_optimizer",
           "trainable_groups"]
