"""Copies of the model, trained at the target's stage, world size and shape on this machine: the resident memory
a rank adds beyond the tensors it allocates (the framework's own share, and the allocator's slack: glibc keeps
freed heap for reuse; CUDA's caching allocator keeps freed blocks), and the time each phase of a step takes.

[Note: measuring allocator slack]
Resident memory is not the sum of live tensors: freed blocks stay with the allocator, fragmented. How
much depends on the sizes a step allocates, so it is measured on a workload like the target's: the
calibration model (a few blocks of the real one) trained by a zerokit engine at the target's stage,
world size, micro-batch and sequence length, in fresh processes. The model states are allocated once, in a few
large tensors, and stay; the rest comes from what a step allocates and frees. So the resident peak over a
few steps, less the resident memory before the model was built and less the model states, is the excess;
the step's peak growth of allocated bytes is measured in another step with the profiler. Part of the excess
follows that growth (freed blocks kept for reuse: 1 + slack per byte) and part does not (the loss head's
temporaries, autograd's and gloo's bookkeeping): with one copy the two cannot be told apart, and the whole
excess priced per byte of growth over-predicted 6-block models from their 2-block copies by up to 15% (a
2-block copy's growth is mostly the head's). So two copies are trained, of `layers` and 3 x `layers` blocks, and a
line through their (growth, excess) gives both parts: excess = fixed + (1 + slack) x growth (or, when two
close points give a line that cannot be, the larger copy alone; See excess_line). The framework's
share is the resident memory before the model was built: Python, torch, zerokit, transformers, gloo.

[Note: timing copies]
FLOPs over a peak rate times an MFU miss on a CPU by tens of percent: the MFU of a 2-block copy is mostly the
loss head's (a 32,000-token projection), the optimizer's rate is measured alone and not beside the gradients'
traffic, and gloo's collectives share the cores that compute. The copies above run the real engine on the
real shapes, so their phases are timed too, as `record_run` times a run (forward with the loss, backward,
step: each after a barrier, wall and CPU seconds, the slowest rank's; the step's collectives replayed
alone). Every phase is a fixed part (embedding, loss head, the step's fixed costs) plus a part per block,
so the line through the two copies, read at the target's number of blocks, is the prediction
(`Calibration.copy_seconds`; zerokit/planner/check.py reads it). The copies have 2 and 6 blocks, not 2 and 4,
because the target is read off the line's far end: from copies of 2 and 4 blocks a 12-block model multiplies
the noise of their difference by 4, and the sweep missed its forward by 29%. The formulas stay the fallback,
and the only way to plan another device.
The copies are the run's as far as its record tells: its engine config (`engine_config`: stage, precision,
reduce dtype, buckets, gradient accumulation: a copy of one micro-step would time a quarter of a 4-micro-step
run), its optimizer kind, and its optimizer groups, by parameter name (the buckets and the step's loops are
laid out per group). Communication is not read off the line: the run's collectives are
known exactly (the plan counts them, kind by kind), so each copy's ranks replay them as `record_run` replays
the run's, and the fastest replay is the prediction; a line through two replays of other collectives
extrapolated their noise (a 2-block copy's replay was at times slower than a 6-block copy's).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch

from zerokit.profiling.device import check_optimizer_kind, torch_optimizer
from zerokit.profiling.measure import AllocationTimeline, resident_bytes


TIMED_STEPS = 4  # optimizer steps each copy is timed over (per step: their mean)


def _copy_rank(rank: int, world: int, model: Any, layers: int, batch: int, seq: int, config: dict, optimizer: str,
               groups: dict[str, int] | None, replay: dict | None) -> dict:
    import zerokit
    from zerokit.profiling.calibrate import build_hf_model
    from zerokit.profiling.record import communication_seconds, slowest, step_collectives, timed_steps

    torch.set_num_threads(int(os.environ.get("ZEROKIT_THREADS", "1")))
    warm = torch.nn.Linear(64, 64)  # kernels and thread pools, as any process that trains has them
    warm(torch.randn(8, 64)).sum().backward()
    gc.collect()
    framework = resident_bytes()
    module = build_hf_model(model, layers)
    engine = zerokit.initialize(module, torch_optimizer(optimizer, _grouped_as_run(module, groups)), config)
    vocab = module.config.vocab_size
    batches = iter(lambda: torch.randint(0, vocab, (batch, seq)), None)

    def loss(engine: Any, tokens: torch.Tensor) -> torch.Tensor:
        return engine(input_ids=tokens, labels=tokens).loss

    step_collectives(engine, loss, batches)  # a first step, untimed
    timed = timed_steps(engine, loss, batches, TIMED_STEPS)
    states = sum(engine.memory_stats().values())
    with AllocationTimeline(torch.device("cpu")) as allocated:
        comm = step_collectives(engine, loss, batches)
    seconds = {**timed["seconds"], "communication": communication_seconds(engine, comm)}
    if replay:
        seconds["run_communication"] = communication_seconds(engine, replay)
    seconds = slowest(seconds)
    return {"framework": framework, "resident_peak": timed["peak_resident"], "states": states,
            "growth": allocated.peak, "seconds": seconds, "cpu_seconds": slowest(timed["cpu_seconds"])}


def _grouped_as_run(module: torch.nn.Module, groups: dict[str, int] | None) -> list[dict]:
    """The copy's parameters in the run's optimizer groups, by name (a copy's blocks are named as the run's first
    blocks), so that its buckets and its step's loops are laid out as the run's."""
    by_group: dict[int, list] = {}
    for name, parameter in module.named_parameters():
        by_group.setdefault((groups or {}).get(name, 0), []).append(parameter)
    return [{"params": by_group[group]} for group in sorted(by_group)]


@dataclass(frozen=True)
class Copies:
    """What copies of `layers` and 3 x `layers` blocks measured (See [Note: measuring allocator slack] and
    [Note: timing copies])."""
    framework: int  # resident bytes before the model was built
    slack: float  # the allocator's slack per byte of the step's growth
    fixed: int  # resident excess that does not follow the step's growth
    seconds: tuple[dict, ...]  # per copy: {"blocks", "seconds" (wall, by phase, and the run's replayed
    #                            collectives as "run_communication" when given), "cpu_seconds"}


def measure_copies(model: Any, batch: int, seq: int, layers: int = 2, world: int = 1, config: dict | None = None,
                   optimizer: str = "adamw", groups: dict[str, int] | None = None,
                   replay: dict | None = None) -> Copies:
    """Train copies of `model` with `layers` and 3 x `layers` blocks on `world` gloo ranks with the target's
    zerokit `config` (default: stage 0, fp32) and `optimizer` (one of OPTIMIZER_KINDS), at its micro-batch and
    sequence length, in fresh processes on this machine; measure their resident memory and time their phases.
    `groups`: the target's optimizer group of each parameter, by name; `replay`: the target's collectives of one
    step (as `comm_stats()` counts them), replayed on each copy's ranks ("run_communication")."""
    check_optimizer_kind(optimizer)  # here, not in a spawned rank
    config = config or {"zero_optimization": {"stage": 0}}
    from zerokit.testing.spawn import spawn

    points, seconds = [], []
    for blocks in (layers, 3 * layers):
        ranks = spawn(_copy_rank, world, model, blocks, batch, seq, config, optimizer, groups, replay)
        result = max(ranks, key=lambda r: r["resident_peak"])
        points.append((result["growth"], result["resident_peak"] - result["framework"] - result["states"]))
        seconds.append({"blocks": blocks, "seconds": ranks[0]["seconds"], "cpu_seconds": ranks[0]["cpu_seconds"]})
    return Copies(result["framework"], *excess_line(*points), tuple(seconds))


def excess_line(small: tuple[int, int], large: tuple[int, int]) -> tuple[float, int]:
    """(slack, fixed bytes) of the line excess = fixed + (1 + slack) x growth through two (growth, excess)
    points. A line that gives resident memory less than a byte per byte of growth, or a negative fixed part,
    is the noise of two close points (a head that dwarfs the blocks grows little with them): then the larger
    copy alone, all of its excess per byte of growth."""
    (small_growth, small_excess), (large_growth, large_excess) = small, large
    if large_growth > small_growth:
        per_byte = (large_excess - small_excess) / (large_growth - small_growth)
        fixed = small_excess - per_byte * small_growth
        if per_byte >= 1 and fixed >= 0:
            return per_byte - 1, round(fixed)
    return max(0.0, large_excess / max(1, large_growth) - 1), 0
