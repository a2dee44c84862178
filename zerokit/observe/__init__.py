"""Observability: DeepSpeed's steps_per_print, wall_clock_breakdown, comms_logger, flops_profiler, csv_monitor,
tensorboard and wandb keys, honoured by one object the engine calls (monitor.py)."""

from zerokit.observe.comms import collective_stats
from zerokit.observe.monitor import EngineMonitor

__all__ = ["EngineMonitor", "collective_stats"]
