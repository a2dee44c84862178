"""The resident memory a rank adds beyond the tensors it allocates: the framework's own share, and the
allocator's slack (glibc keeps freed heap for reuse; CUDA's caching allocator keeps freed blocks).

[Note: measuring allocator slack]
Resident memory is not the sum of live tensors: freed blocks stay with the allocator, fragmented. How
much depends on the sizes a step allocates, so it is measured on a workload like the target's: the
calibration model (a few blocks of the real one) trained by a 1-rank zerokit engine at the target's
micro-batch and sequence length, in a fresh process. The model states are allocated once, in a few
large tensors, and stay; the slack comes from what a step allocates and frees. So its resident peak over
a few steps, less its resident memory before the model was built and less its model states, divided by
the step's peak growth of allocated bytes (measured in another step with the profiler), is 1 + slack. The framework's share is
the resident memory before the model was built: Python, torch, zerokit, transformers, gloo.
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
                     world: int = 1) -> tuple[int, float]:
    """(framework resident bytes, allocator slack) on this machine, with `world` gloo ranks training at
    `stage`; See [Note: measuring allocator slack]."""
    from zerokit.testing.spawn import spawn

    result = max(spawn(_slack_rank, world, model, layers, precision, batch, seq, stage),
                 key=lambda r: r["resident_peak"])
    slack = (result["resident_peak"] - result["framework"] - result["states"]) / max(1, result["growth"]) - 1
    return result["framework"], max(0.0, slack)
