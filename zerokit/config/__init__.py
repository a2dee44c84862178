"""The config: DeepSpeed's keys read once (dsconfig/), the typed config checked once (typed.py: ZeroConfig and
its policies), the defaults (defaults.py), the run's settings (settings.py: one part per room, the engine's decisions)
and resolve.py, which makes them from the config and the run's facts. The names of typed.py and resolve.py are
re-exported here, imported on first use: dsconfig/, defaults.py and settings.py are torch-free and the planner
imports them; typed.py and resolve.py import torch."""

from zerokit._support.lazy import lazy_names

_LAZY = {**dict.fromkeys(["ActivationCheckpointing", "CommsLogger", "FlopsProfiler", "LossScaling", "MixedPrecision",
                          "Monitor", "Offload", "OptimizerSpec", "Preemption", "Resume", "SchedulerSpec",
                          "Stage3Policy", "Wandb", "ZeroConfig", "from_dict", "hidden_size_of", "load_config",
                          "replace"], "zerokit.config.typed"),
         **dict.fromkeys(["engine_choices", "engine_settings", "parts_before_facts", "plain_fields", "resolve"],
                         "zerokit.config.resolve")}
__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY, globals())
