"""The config: DeepSpeed's keys read once (dsconfig/), the typed config checked once (typed.py: ZeroConfig and
its policies), the defaults (defaults.py) and the run's settings (settings.py). The typed config's names are
re-exported here, imported on first use: dsconfig/, defaults.py and settings.py are torch-free and the planner
imports them, typed.py imports torch."""

from zerokit._support.lazy import lazy_names

_LAZY = dict.fromkeys(["ActivationCheckpointing", "CommsLogger", "FlopsProfiler", "LossScaling", "MixedPrecision",
                       "Monitor", "Offload", "OptimizerSpec", "Preemption", "Resume", "SchedulerSpec", "Stage3Policy",
                       "Wandb", "ZeroConfig", "engine_choices", "engine_settings", "from_dict", "hidden_size_of",
                       "load_config", "parts_before_facts", "plain_fields", "replace", "resolve"],
                      "zerokit.config.typed")
__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY, globals())
