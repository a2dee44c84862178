"""What an engine holds, as plain values: `engine.state_dict()` (everything a resumed run in the same layout
needs) and its load, and the bytes it holds by category. Checkpoints, which resume at any world size and
stage, read parameters through the per-parameter view instead (zerokit/checkpoint)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

from zerokit.stages import ZeroStage
from zerokit.engine.step import Progress

CATEGORIES = ("parameters", "gradients", "optimizer_state")


def engine_state_dict(stage: ZeroStage, loss_scaler: Any, progress: Progress,
                      lr_schedules: list[Any]) -> dict[str, Any]:
    """This rank's shard of the model states (masters, optimizer, and at stage 3 the frozen shards), the loss
    scaler, the step counters, and the LR schedules the engine steps (when it steps any)."""
    state = {"stage": stage.state_dict(), "loss_scaler": loss_scaler.state_dict(), "progress": asdict(progress)}
    if lr_schedules:
        state["lr_schedules"] = [schedule.state_dict() for schedule in lr_schedules]
    return state


def load_engine_state(state: Mapping[str, Any], stage: ZeroStage, loss_scaler: Any,
                      lr_schedules: list[Any]) -> Progress:
    """The inverse of engine_state_dict, on the same world size, stage and layout; returns the progress."""
    saved_schedules = state.get("lr_schedules", [])
    if saved_schedules and len(saved_schedules) != len(lr_schedules):
        raise ValueError(f"the saved state has {len(saved_schedules)} LR schedules, this engine "
                         f"{len(lr_schedules)}; resume with the same `scheduler` block")
    stage.load_state_dict(state["stage"])
    loss_scaler.load_state_dict(state["loss_scaler"])
    for schedule, saved in zip(lr_schedules, saved_schedules):
        schedule.load_state_dict(saved)
    return Progress(**state["progress"])


def totals(by_tier: dict[str, dict[str, int]]) -> dict[str, int]:
    """Bytes by category, every tier together."""
    return {category: sum(categories[category] for categories in by_tier.values()) for category in CATEGORIES}


__all__ = ["engine_state_dict", "load_engine_state", "totals"]
