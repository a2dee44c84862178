"""`deepspeed.runtime.zero` for zerokit: partition_parameters (what transformers patches around zero.Init) and
the Init / GatheredParameters of zerokit.deepspeed.zero."""

from zerokit.deepspeed.runtime.zero import partition_parameters
from zerokit.deepspeed.zero import GatheredParameters, Init

__all__ = ["partition_parameters", "Init", "GatheredParameters"]
