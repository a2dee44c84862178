"""The optimizer side of a step: fp32 master weights, their gradients, and the optimizers over them."""

from zerokit.masters.homes import DeviceHome, HostHome, copy_edits
from zerokit.masters.optimizer import GroupRef, optimizer_kind, rebuild_optimizer, trainable_groups
from zerokit.masters.shards import OptimizerPlan, PieceRef, ShardMasters

__all__ = ["DeviceHome", "GroupRef", "HostHome", "OptimizerPlan", "PieceRef", "ShardMasters", "copy_edits",
           "optimizer_kind", "rebuild_optimizer", "trainable_groups"]
