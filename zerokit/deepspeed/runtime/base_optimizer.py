"""`deepspeed.runtime.base_optimizer.DeepSpeedOptimizer` for zerokit: Lightning's Fabric tells DeepSpeed's ZeRO
optimizer wrappers by this base class. zerokit's engine.optimizer is the torch optimizer it steps on the master
shards, never a DeepSpeedOptimizer, so isinstance answers False, as it does in DeepSpeed for a basic optimizer."""


class DeepSpeedOptimizer:
    """DeepSpeed's marker base class of its ZeRO optimizer wrappers."""


__all__ = ["DeepSpeedOptimizer"]
