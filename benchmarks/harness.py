"""One rank of one contender: build, warm up, time, measure. Runs inside a spawned process.

The order matters for the numbers: the peer's package is imported and its communication set up
first, the libraries are warmed up on a tiny model, then the memory baseline is taken (See [Note:
peak RSS growth]), then the model is built and handed to the contender. Every step starts after a
barrier, so a step's time is the time of the slowest rank for that step, which
is what the job sees; per-rank times are all-reduced (max) after the loop, not during it.

Besides wall time, each step's CPU time (all threads of the process, `time.process_time`) is
recorded: it leaves out time spent waiting for a core that another process holds, so on a shared
machine it is the steadier of the two, though it also leaves out waiting on a peer rank.

Model-state bytes are measured twice on the last step: after backward, when gradients are live
(the peak of model states for a stage that keeps full or reduced gradients until the step), and
after the step. The clock is stopped while the first is taken. Then one more step, untimed, counts
the collectives (benchmarks/commcount.py), and a shared batch gives the eval loss.
"""

from __future__ import annotations

import importlib
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.accounting import live_tensor_bytes, peak_growth, start_peak_memory
from benchmarks.commcount import CollectiveCounter
from benchmarks.contenders import Contender
from benchmarks.workload import EVAL_RANK, BenchSettings, make_batch, make_model, union_batch
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss


class StepClock:
    """Wall and CPU time of one step by phase, from construction on; `restart` leaves out a pause."""

    PHASES = ("forward", "backward", "step")  # forward includes the loss; step includes the all-gather

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.restart()

    def restart(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def lap(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.wall[phase], self.cpu[phase] = wall - self._wall, cpu - self._cpu
        self._wall, self._cpu = wall, cpu


def warm_up_libraries() -> None:
    """One step of zerokit's tiny test model and a collective, before the memory baseline: the first
    forward, backward, optimizer step and gloo call map kernels and grow thread pools and gloo
    buffers, a fixed cost of any process that trains, not of the contender under test."""
    model = TinyGPT(TinyGPTConfig(with_test_features=False))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.zeros(2, model.config.block_size + 1, dtype=torch.long)
    lm_loss(model(tokens[:, :-1]), tokens).backward()
    optimizer.step()
    dist.all_reduce(torch.zeros(1024))
    dist.barrier()


def run_rank(rank: int, world_size: int, contender: Contender, settings: BenchSettings) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=FutureWarning)  # peers call torch APIs that 2.13 deprecates
    if contender.requires is not None:
        importlib.import_module(contender.requires)
    if contender.prepare is not None:
        contender.prepare()
    warm_up_libraries()
    memory = start_peak_memory()
    model = make_model(settings)
    trainable_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer = contender.build(model, settings)

    laps: list[StepClock] = []
    losses: list[float] = []
    states_after_backward: dict[str, int] = {}
    total_steps = settings.warmup + settings.steps
    for step in range(total_steps):
        tokens = union_batch(settings, step) if contender.single_process else make_batch(settings, rank, step)
        dist.barrier()
        clock = StepClock()
        loss = lm_loss(trainer.forward(tokens[:, :-1]), tokens)
        clock.lap("forward")
        trainer.backward(loss)
        clock.lap("backward")
        if step == total_steps - 1:
            states_after_backward = trainer.state_bytes()
            clock.restart()  # the measurement is not part of the step
        trainer.step()
        clock.lap("step")
        if step >= settings.warmup:
            laps.append(clock)
        losses.append(loss.item())

    peak = peak_growth(memory)
    states_after_step = trainer.state_bytes()
    with CollectiveCounter() as counter:  # one more step, untimed: See benchmarks/commcount.py
        tokens = union_batch(settings, total_steps) if contender.single_process else make_batch(settings, rank, total_steps)
        trainer.backward(lm_loss(trainer.forward(tokens[:, :-1]), tokens))
        trainer.step()

    step_seconds = torch.tensor([sum(clock.wall.values()) for clock in laps], dtype=torch.float64)
    dist.all_reduce(step_seconds, op=dist.ReduceOp.MAX)  # each step lasts as long as its slowest rank
    step_cpu_seconds = torch.tensor([sum(clock.cpu.values()) for clock in laps], dtype=torch.float64)
    dist.all_reduce(step_cpu_seconds, op=dist.ReduceOp.MAX)
    eval_tokens = make_batch(settings, EVAL_RANK, 0)
    with torch.no_grad():
        eval_loss = lm_loss(trainer.forward(eval_tokens[:, :-1]), eval_tokens).item()

    return {
        "rank": rank,
        "trainable_numel": trainable_numel,
        "step_seconds": step_seconds.tolist(),  # max over ranks, per timed step
        "phase_seconds": {phase: [clock.wall[phase] for clock in laps] for phase in StepClock.PHASES},  # this rank's
        "phase_cpu_seconds": {phase: [clock.cpu[phase] for clock in laps] for phase in StepClock.PHASES},
        "median_step_seconds": statistics.median(step_seconds.tolist()),
        "step_cpu_seconds": step_cpu_seconds.tolist(),  # max over ranks, per timed step
        "train_losses": losses,  # this rank's batches, warm-up included
        "eval_loss": eval_loss,  # a shared batch after the last step: equal on all ranks if in sync
        "peak_rss_growth_bytes": peak,
        "baseline_rss_bytes": memory.baseline,
        "peak_method": memory.method,
        "states_after_backward": states_after_backward,
        "states_after_step": states_after_step,
        "live_tensor_bytes": live_tensor_bytes(),
        "comm_per_step": counter.counts,
    }
