"""The resident memory a rank adds beyond the tensors it allocates: the framework's own share, and the
allocator's slack (glibc keeps freed heap for reuse; CUDA's caching allocator keeps freed blocks).

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
2-block copy's growth is mostly the head's). So two copies are trained, of `layers` and 2 x `layers` blocks, and a
line through their (growth, excess) gives both parts: excess = fixed + (1 + slack) x growth (or, when two
close points give a line that cannot be, the larger copy alone; See excess_line). The framework's
share is the resident memory before the model was built: Python, torch, zerokit, transformers, gloo.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from zerokit.profiling.measure import AllocationTimeline, resident_bytes, resident_peak


def _slack_rank(rank: int, world: int, model: Any, layers: int, precision: str, batch: int, seq: int,
                stage: int) -> dict:
    import zerokit
    from zerokit.profiling.calibrate import build_hf_model

    torch.set_num_threads(int(os.environ.get("ZEROKIT_THREADS", "1")))
    warm = torch.nn.Linear(64, 64)  # kernels and thread pools, as any process that trains has them
    warm(torch.randn(8, 64)).sum().backward()
    gc.collect()
    framework = resident_bytes()
    module = build_hf_model(model, layers)
    optimizer = torch.optim.AdamW(module.parameters())
    engine = zerokit.initialize(module, optimizer, {"zero_optimization": {"stage": stage},
                                                    "bf16": {"enabled": precision == "bf16"}})
    vocab = module.config.vocab_size

    def step() -> None:
        tokens = torch.randint(0, vocab, (batch, seq))
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()

    step()
    with resident_peak() as resident:
        step()
        step()
    states = sum(engine.memory_stats().values())
    with AllocationTimeline(torch.device("cpu")) as allocated:
        step()
    return {"framework": framework, "resident_peak": resident["peak"], "states": states, "growth": allocated.peak}


def measure_resident(model: Any, precision: str, batch: int, seq: int, layers: int = 2, stage: int = 0,
                     world: int = 1) -> tuple[int, float, int]:
    """(framework resident bytes, allocator slack, fixed excess bytes) on this machine, with `world` gloo ranks
    training copies of `layers` and 2 x `layers` blocks at `stage`; See [Note: measuring allocator slack]."""
    from zerokit.testing.spawn import spawn

    points = []
    for blocks in (layers, 2 * layers):
        result = max(spawn(_slack_rank, world, model, blocks, precision, batch, seq, stage),
                     key=lambda r: r["resident_peak"])
        points.append((result["growth"], result["resident_peak"] - result["framework"] - result["states"]))
    return (result["framework"], *excess_line(*points))


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
