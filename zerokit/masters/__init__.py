"""The optimizer side of a step: fp32 master weights, their gradients, and the optimizers over them. Where each
master lives (device, host memory, NVMe) is its home's business: zerokit/tiers/."""

from zerokit.masters.optimizer import GroupRef, optimizer_kind, rebuild_optimizer, trainable_groups
from zerokit.masters.shards import OptimizerPlan, PieceRef, ShardMasters, share_optimizers

__all__ = ["GroupRef", "OptimizerPlan", "PieceRef", "ShardMasters", "optimizer_kind", "rebuild_optimizer",
           "share_optimizers", "trainable_groups"]
