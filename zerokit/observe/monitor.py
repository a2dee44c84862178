"""What the engine reports while it trains, as DeepSpeed's observability keys ask: the one object the engine
calls, from one marked place each in forward, backward and step.

    steps_per_print       every N optimizer steps, on rank 0: loss, learning rate, grad norm, loss scale,
                          skipped steps, time per step and samples/s (logger 'zerokit')
    wall_clock_breakdown  every optimizer step: forward/backward/reduce/step times (timers.py)
    comms_logger          every optimizer step: what the collectives moved (comms.py)
    flops_profiler        at one optimizer step: its FLOPs (flops.py)
    csv_monitor, tensorboard, wandb
                          every optimizer step: DeepSpeed's events (writers.py)

Every part is off unless its key turns it on; with all off the calls cost a context manager each. Steps are
counted as DeepSpeed counts global_steps: every accumulation boundary, skipped ones included. The loss
reported is rank 0's (the mean over its micro-steps): averaging it over ranks would add a collective to a
step the user did not ask for.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Protocol

import torch
from torch import nn

from zerokit.observe.comms import CommsReport
from zerokit.observe.flops import FlopsProfile
from zerokit.observe.timers import PhaseTimers, breakdown_line
from zerokit.observe.writers import Event, writers_for
from zerokit.precision.result import StepResult
from zerokit.config.settings import ObserveSettings
from zerokit._support.log import logger

Lap = Callable[[str], None]


class Observed(Protocol):
    """What the monitor reads from the engine."""

    module: nn.Module
    rank: int
    device: torch.device

    def get_lr(self) -> list[float]: ...

    def comm_stats(self) -> dict[str, dict[str, int]]: ...

    def trainable_numel(self) -> int: ...


def lap_clock(timers: PhaseTimers | None) -> Lap:
    """`lap(phase)`: the time since the previous lap (or now) belongs to `phase`; nothing without timers."""
    if timers is None:
        return no_lap
    mark = timers.now()

    def lap(phase: str) -> None:
        nonlocal mark
        now = timers.now()
        timers.add(phase, now - mark)
        mark = now
    return lap


def no_lap(phase: str) -> None:
    pass


class EngineMonitor:
    def __init__(self, part: ObserveSettings, engine: Observed) -> None:
        self.engine, self.part = engine, part
        rank0 = engine.rank == 0
        self.timers = PhaseTimers(engine.device) if part.wall_clock_breakdown else None
        self.steps_per_print = part.steps_per_print if rank0 else None
        self.comms = CommsReport(part.comms_logger, engine.comm_stats()) \
            if part.comms_logger.enabled and rank0 else None
        self.flops = FlopsProfile(part.flops_profiler, engine.trainable_numel()) \
            if part.flops_profiler.enabled and rank0 else None
        self.writers = writers_for(part) if rank0 else []
        self.keeps_loss = bool(self.steps_per_print or self.writers)
        self.losses: list[torch.Tensor] = []  # this optimizer step's micro-step losses, detached
        self.completed = 0  # accumulation boundaries so far (DeepSpeed's global_steps)
        self.printed_at = (0, time.perf_counter())  # (step, time) of the last steps_per_print line

    # --- the engine's three call sites ---------------------------------------------------------------
    @contextmanager
    def forward(self) -> Iterator[None]:
        started = self.timers.now() if self.timers else 0.0
        with self.flops.forward_phase(self.completed) if self.flops else nullcontext():
            yield
        if self.timers:
            self.timers.add("forward", self.timers.now() - started)

    @contextmanager
    def backward(self, loss: torch.Tensor | None) -> Iterator[Lap]:
        """Yields `lap(phase)`: the time since the previous lap (or the start) belongs to `phase`. `loss` None: a
        backward the engine did not start (a pipeline schedule's), whose loss the caller reports."""
        if self.keeps_loss and loss is not None:
            self.losses.append(loss.detach())
        timers = self.timers
        if timers is None and self.flops is None:
            yield no_lap
            return
        started = timers.now() if timers else 0.0
        with self.flops.backward_phase(self.completed) if self.flops else nullcontext():
            yield lap_clock(timers)
        if timers:
            timers.add("backward", timers.now() - started)

    @contextmanager
    def step(self) -> Iterator[tuple[Callable[[StepResult], StepResult], Lap]]:
        """Yields `done(result)`, to be called with the step's result, which it returns, and `lap(phase)` for the
        step's own phases (optimizer_gradients, optimizer_step, optimizer_allgather)."""
        started = self.timers.now() if self.timers else 0.0

        def done(result: StepResult) -> StepResult:
            if self.timers:
                self.timers.add("step", self.timers.now() - started)
            if result.boundary:
                self._boundary(result)
            return result
        yield done, lap_clock(self.timers)

    # --- at each optimizer step ----------------------------------------------------------------------
    def _boundary(self, result: StepResult) -> None:
        step = self.completed + 1  # DeepSpeed numbers the step just finished from 1 in its logs
        loss = torch.stack(self.losses).float().mean().item() if self.losses else math.nan
        self.losses.clear()
        events: list[Event] = []
        samples = step * (self.part.train_batch_size or 0)
        if self.writers:
            events += [("Train/Samples/train_loss", loss, samples),
                       ("Train/Samples/lr", self.engine.get_lr()[0], samples),
                       ("Train/Samples/grad_norm", _finite_or_nan(result.grad_norm), samples)]
            if self.part.is_fp16:
                events.append(("Train/Samples/loss_scale", result.loss_scale, samples))
        if self.timers:
            times = self.timers.close_window()
            if self.engine.rank == 0:
                logger.info(breakdown_line(step, times))
            events += [(f"Train/Samples/elapsed_time_ms_{_deepspeed_phase(phase)}", ms, samples)
                       for phase, ms in times.items()]
        if self.comms:
            logger.info(self.comms.line(step, self.engine.comm_stats()))
        if self.flops and self.flops.active(self.completed):
            for line in self.flops.finish(self.completed):
                logger.info(line)
        if self.steps_per_print and step % self.steps_per_print == 0:
            logger.info(self._progress_line(step, loss, result))
        for writer in self.writers:
            writer.write(events)
        self.completed = step

    def _progress_line(self, step: int, loss: float, result: StepResult) -> str:
        last_step, last_time = self.printed_at
        now = time.perf_counter()
        self.printed_at = (step, now)
        per_step = (now - last_time) / max(1, step - last_step)
        rate = f" ({self.part.train_batch_size / per_step:.1f} samples/s)" if self.part.train_batch_size else ""
        return (f"step {step} | loss {loss:.4f} (rank 0) | lr {_rates(self.engine.get_lr())} | grad norm "
                f"{_finite_or_nan(result.grad_norm):.4f} | loss scale {result.loss_scale:g} | skipped "
                f"{result.total_skips} | {per_step:.3f} s/step{rate}")

    @property
    def wall_clock_times(self) -> dict[str, float]:
        """The last optimizer step's phase times in ms (empty without wall_clock_breakdown)."""
        return dict(self.timers.last) if self.timers else {}

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def _deepspeed_phase(phase: str) -> str:
    return "backward_allreduce" if phase == "backward_reduce" else phase


def _finite_or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _rates(rates: list[float]) -> str:
    distinct = sorted(set(rates))
    return f"{distinct[0]:.4e}" if len(distinct) == 1 else "[" + ", ".join(f"{rate:.4e}" for rate in rates) + "]"


__all__ = ["EngineMonitor", "Observed"]
