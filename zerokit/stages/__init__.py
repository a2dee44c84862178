"""One class per ZeRO stage; each differs from the last only in what it shards."""

from zerokit.stages.base import ZeroStage
from zerokit.stages.hooks import install_hooks
from zerokit.stages.reducer import BucketReducer
from zerokit.stages.stage0 import DataParallel
from zerokit.stages.stage1 import ShardedOptimizerState
from zerokit.stages.stage2 import ShardedGradients
from zerokit.stages.stage3 import ShardedParameters

STAGES: dict[int, type[ZeroStage]] = {
    0: DataParallel, 1: ShardedOptimizerState, 2: ShardedGradients, 3: ShardedParameters}

__all__ = ["STAGES", "BucketReducer", "DataParallel", "ShardedGradients", "ShardedOptimizerState", "ShardedParameters",
           "ZeroStage", "install_hooks"]
