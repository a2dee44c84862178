"""zerokit: ZeRO (the Zero Redundancy Optimizer) for PyTorch, and a planner that says which stage
to use before you rent a GPU.

Names are imported on first use, so that `zerokit plan` (pure Python) does not pay for importing torch.
"""

from zerokit._support.lazy import lazy_names
from zerokit._support.torchrun import warn_if_restarted_under_shared_store

__version__ = "0.1.0"

_LAZY = {
    "Engine": "zerokit.engine.engine", "SkippedStepsError": "zerokit.engine.step",
    "initialize": "zerokit.engine.engine", "LossScaling": "zerokit.config.typed",
    "MixedPrecision": "zerokit.config.typed", "Stage3Policy": "zerokit.config.typed",
    "ZeroConfig": "zerokit.config.typed", "load_config": "zerokit.config.typed",
    "StepResult": "zerokit.precision.result", "plan": "zerokit.planner", "estimate": "zerokit.planner",
    "safetensors_init": "zerokit.stages.construction", "Layout": "zerokit.parallel.mesh",
}
__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY, globals())
warn_if_restarted_under_shared_store()  # See [Note: a key space per attempt] in zerokit/comm/rendezvous.py
