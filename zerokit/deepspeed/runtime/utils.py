"""`deepspeed.runtime.utils` for zerokit: set_random_seed, which DeepSpeed's pipeline examples call, and the
partition arithmetic of PipelineModule (zerokit/deepspeed/pipe.py)."""

from zerokit.deepspeed.pipe import _set_random_seed as set_random_seed
from zerokit.deepspeed.pipe import partition_balanced, partition_uniform

__all__ = ["set_random_seed", "partition_balanced", "partition_uniform"]
