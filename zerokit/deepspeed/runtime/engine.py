"""`deepspeed.runtime.engine` for zerokit: DeepSpeedEngine, the class initialize() returns."""

from zerokit.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
