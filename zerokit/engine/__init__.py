"""The engine: engine.py (initialize, Engine), build.py (the pieces it is built from), backward.py (backward
driven from outside), step.py (the optimizer step and the progress), state.py, checkpoints.py, schedules.py,
activations.py and startup.py (the start-up log). Names are imported on first use."""

from zerokit._support.lazy import lazy_names

_LAZY = dict.fromkeys(["Engine", "initialize"], "zerokit.engine.engine")
__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY, globals())
