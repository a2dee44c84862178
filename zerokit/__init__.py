"""zerokit: ZeRO (the Zero Redundancy Optimizer) for PyTorch, and a planner that says which stage
to use before you rent a GPU."""

from zerokit.config import LossScaling, MixedPrecision, ZeroConfig, load_config
from zerokit.engine import Engine, SkippedStepsError, initialize
from zerokit.precision import StepResult

__version__ = "0.1.0"

__all__ = ["Engine", "LossScaling", "MixedPrecision", "SkippedStepsError", "StepResult", "ZeroConfig",
           "initialize", "load_config"]
