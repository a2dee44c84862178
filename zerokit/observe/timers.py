"""Wall-clock times of a step's phases (DeepSpeed's wall_clock_breakdown), summed over the micro-steps of one
optimizer step.

Phases, with DeepSpeed's names for what they measure:
  forward              the module's forward (stage 3: with its parameter gathers)
  backward             all of engine.backward(): the two below and the stage's bookkeeping
  backward_inner       autograd's backward (with the bucket reductions it overlaps)
  backward_reduce      waiting for the reductions still in flight after autograd (DeepSpeed: backward_allreduce)
  step                 engine.step(): the three below, the LR schedules and the report
  optimizer_gradients  unscale, the global norm and overflow check (a float64 sum of squares and its all-reduce)
  optimizer_step       clipping and the optimizer on the fp32 masters (an offloaded one's on the host)
  optimizer_allgather  publishing the masters into the compute-dtype shards (stages 1-2: and all-gathering them)

On a GPU every reading synchronizes the device first, as DeepSpeed's timers do, so that a phase is charged
for the kernels it launched; that costs a little overlap, and only while the key is on.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

PHASES = ("forward", "backward", "backward_inner", "backward_reduce", "step", "optimizer_gradients", "optimizer_step",
          "optimizer_allgather")


class PhaseTimers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.window: dict[str, float] = defaultdict(float)  # phase -> milliseconds in this optimizer step
        self.last: dict[str, float] = {}  # the previous optimizer step's times (engine.get_wall_clock_timers)

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.window[phase] += seconds * 1000.0

    def close_window(self) -> dict[str, float]:
        """This optimizer step's times, in PHASES order; the next step starts from zero."""
        self.last = {phase: self.window.get(phase, 0.0) for phase in PHASES}
        self.window.clear()
        return self.last


def breakdown_line(step: int, times: dict[str, float]) -> str:
    return f"step {step} time (ms) | " + " | ".join(f"{phase}: {times[phase]:.2f}" for phase in PHASES)


__all__ = ["PHASES", "PhaseTimers", "breakdown_line"]
