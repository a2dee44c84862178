"""Counted bytes are exact, so they are tested exactly: what each rank holds (the ZeRO paper's
model-state formula, with our padding) and what each collective moves per optimizer step."""

from __future__ import annotations

import pytest

from conftest import WORLD_SIZES, cases_for
from zerokit.testing.parity import Case

FROZEN_NUMEL = 24 * 24 + 24  # TinyGPT's frozen Linear(24, 24)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
REDUCE_BYTES = 4  # fp32 reduction, the default
ADAMW = [(n, c) for n in WORLD_SIZES for c in cases_for(n) if c.optimizer == "adamw"]


def expected_memory(case: Case, world_size: int, padded: int, buckets: int) -> dict[str, int]:
    """The paper's accounting with this run's dtypes. padded = Ψ plus bucket padding; every bucket
    is one master tensor whose AdamW state is exp_avg + exp_avg_sq (fp32) and a 4-byte step count."""
    param_bytes = DTYPE_BYTES[case.dtype]
    shards = 1 if case.stage == 0 else world_size
    master_bytes = 0 if case.dtype == "fp32" else 4  # fp32 trains the parameters themselves
    gradients = param_bytes * padded if case.stage < 2 else REDUCE_BYTES * padded // world_size
    return {
        "parameters": param_bytes * (padded + FROZEN_NUMEL),
        "gradients": gradients,
        "optimizer_state": (master_bytes + 8) * padded // shards + 4 * buckets,
    }


@pytest.mark.parametrize("world_size,case", ADAMW, ids=[f"N{n}-{c.name}" for n, c in ADAMW])
def test_memory_by_category_matches_formula(parity_runs, world_size: int, case: Case) -> None:
    for out in (runs[case.name] for runs in parity_runs(world_size)):
        padded, buckets = out["layout_numel"], out["buckets"]
        assert out["trainable_numel"] <= padded < out["trainable_numel"] + buckets * world_size
        assert out["memory"] == expected_memory(case, world_size, padded, buckets)


@pytest.mark.parametrize("world_size,case", ADAMW, ids=[f"N{n}-{c.name}" for n, c in ADAMW])
def test_collectives_per_step(parity_runs, world_size: int, case: Case) -> None:
    out = parity_runs(world_size)[0][case.name]
    padded, buckets = out["layout_numel"], out["buckets"]
    for step, result in zip(out["comm_per_step"][1:], out["results"][1:]):  # every step moves the same
        assert step["broadcast"]["calls"] == 0
        if case.stage == 0:  # DDP: one all-reduce of every gradient, nothing else
            assert step["all_reduce"] == {"calls": buckets, "elements": padded, "bytes": REDUCE_BYTES * padded}
            assert step["reduce_scatter"]["calls"] == step["all_gather"]["calls"] == 0
            continue
        reductions = case.accumulation if case.stage == 2 and case.reduce_every_micro_step else 1
        assert step["reduce_scatter"] == {"calls": reductions * buckets, "elements": reductions * padded,
                                          "bytes": reductions * REDUCE_BYTES * padded}
        gathers = 0 if result["skipped"] else 1  # a skipped step changes no parameter: nothing to gather
        assert step["all_gather"] == {"calls": gathers * buckets, "elements": gathers * padded,
                                      "bytes": gathers * DTYPE_BYTES[case.dtype] * padded}
        assert step["all_reduce"] == {"calls": 1, "elements": 1, "bytes": 4}  # the global grad norm


def test_stages_1_and_2_move_what_ddp_moves(parity_runs) -> None:
    """Per rank on a ring: all-reduce sends 2(N-1)/N x Ψ; reduce-scatter + all-gather send
    (N-1)/N x Ψ each: the same 2Ψ elements, up to padding."""
    runs = parity_runs(3)[0]
    ddp = runs["stage0-fp32"]["comm_per_step"][-1]["all_reduce"]["elements"]
    for name in ("stage1-fp32", "stage2-fp32"):
        step = runs[name]["comm_per_step"][-1]
        sharded = step["reduce_scatter"]["elements"] + step["all_gather"]["elements"]
        assert abs(sharded - 2 * ddp) <= 2 * runs[name]["buckets"] * 3
