"""What one call to `engine.step()` did, as every engine and monitor reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepResult:
    """What one call to `engine.step()` did. Every field is visible on every step, so a run that stops
    updating (loss-scale spiral, inf gradients) is loud, not silent."""

    micro_step: int  # micro-steps taken so far, this one included
    optimizer_step: int  # optimizer steps taken so far (skipped ones not counted)
    boundary: bool  # this micro-step ended an accumulation window
    stepped: bool  # the optimizer ran and parameters changed
    skipped: bool  # a boundary step thrown away because gradients were inf/nan
    loss_scale: float
    grad_norm: float | None  # global norm before clipping (None off the boundary)
    clipped: bool
    consecutive_skips: int
    total_skips: int
