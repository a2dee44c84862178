"""Counted bytes are exact, so they are tested exactly: what each rank holds (the ZeRO paper's
model-state formula, with our padding) and what each collective moves per optimizer step."""

from __future__ import annotations

import pytest

from conftest import WORLD_SIZES, cases_for
from zerokit.testing.parity import Case

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
REDUCE_BYTES = 4  # fp32 reduction, the default
# The formulas assume every parameter was stepped (has optimizer state): not so where a layer stays idle; and
# every state on the device (offload tiers are counted in tests/test_offload.py).
ADAMW = [(n, c) for n in WORLD_SIZES for c in cases_for(n) if c.optimizer == "adamw" and c.usage == "rotating"
         and c.offload_optimizer == c.offload_param == "none"]


def expected_memory(case: Case, world_size: int, out: dict) -> dict[str, int]:
    """The paper's accounting with this run's dtypes. padded = Ψ plus bucket padding; every bucket
    is one master tensor, stepped in pieces (one or more per parameter slice: sub_group_size), and each
    piece's AdamW state is exp_avg + exp_avg_sq (fp32) and a 4-byte step count; padding has no state.
    Stages 0-2: frozen parameters are held whole by every rank. Stage 3: each unit's frozen parameters
    are one buffer padded to a multiple of N, of which a rank keeps its shard; persistent units (by
    their trainable and frozen size) are also held whole; the trainable shards are the masters in a 16-bit run with
    both on the device. Stage 0's gradient buffer ends in one usage flag
    per trainable tensor (See [Note: parameters no rank used] in zerokit/stages/usage.py). After the step, no
    gradient is held (See gradients_at_boundary for what the last backward left)."""
    padded, pieces = out["layout_numel"], out["optimizer_pieces"]
    param_bytes = DTYPE_BYTES[case.dtype]
    shards = 1 if case.stage == 0 else world_size
    master_bytes = 0 if case.dtype == "fp32" else 4  # fp32 trains the parameters themselves
    flags = out["trainable_tensors"] if case.stage == 0 else 0
    held_params, held_frozen = padded, out["frozen_numel"]
    if case.stage == 3:
        trainable, frozen = out["unit_numel"], out["unit_frozen_numel"]
        persistent = [i for i in range(len(trainable)) if 0 < trainable[i] + frozen[i] < case.persistence_threshold]
        # a 16-bit run's trainable shards are its fp32 masters, counted with them, where both stay on the device (See
        # [Note: the shard is the fp32 master] in zerokit/flat/sharded.py)
        masters_are_shards = case.dtype != "fp32" and case.offload_optimizer == "none" and case.offload_param == "none"
        held_params = (0 if masters_are_shards else padded // world_size) + sum(trainable[i] for i in persistent)
        held_frozen = out["frozen_shard_numel"] + sum(frozen[i] for i in persistent)
    return {
        "parameters": param_bytes * (held_params + held_frozen),
        "gradients": 0,  # let go of at the step (See [Note: gradients live from a window's first backward ...])
        "optimizer_state": master_bytes * padded // shards + 8 * out["stepped_numel"] + 4 * pieces,
    }


def gradients_at_boundary(case: Case, world_size: int, out: dict) -> int:
    """Gradient bytes after the backward that ends a window, before its step. Stages 0-1: the whole flat gradient
    in the compute dtype (stage 0 with its usage flags), and the owned part reduced into fp32 copies when the
    compute dtype is narrower (stage 0: all of it; stage 1: this rank's shard). Stages 2-3: this rank's fp32 shard."""
    padded = out["layout_numel"]
    if case.stage >= 2:
        return REDUCE_BYTES * padded // world_size
    flags = out["trainable_tensors"] if case.stage == 0 else 0
    widened = REDUCE_BYTES * padded // (1 if case.stage == 0 else world_size) if case.dtype != "fp32" else 0
    return DTYPE_BYTES[case.dtype] * (padded + flags) + widened


@pytest.mark.parametrize("world_size,case", ADAMW, ids=[f"N{n}-{c.name}" for n, c in ADAMW])
def test_memory_by_category_matches_formula(parity_runs, world_size: int, case: Case) -> None:
    for out in (runs[case.name] for runs in parity_runs(world_size)):
        padded, buckets = out["layout_numel"], out["buckets"]
        assert out["trainable_numel"] <= padded < out["trainable_numel"] + buckets * world_size
        assert out["memory"] == expected_memory(case, world_size, out)
        assert out["memory_at_boundary"]["gradients"] == gradients_at_boundary(case, world_size, out)
        if case.sub_group_size:  # the masters really were cut into pieces
            assert out["optimizer_pieces"] > out["buckets"]


@pytest.mark.parametrize("world_size,case", ADAMW, ids=[f"N{n}-{c.name}" for n, c in ADAMW])
def test_collectives_per_step(parity_runs, world_size: int, case: Case) -> None:
    out = parity_runs(world_size)[0][case.name]
    padded, buckets, flags = out["layout_numel"], out["buckets"], out["trainable_tensors"]
    for step, result in zip(out["comm_per_step"][1:], out["results"][1:]):  # every step moves the same
        # nothing is broadcast but rank 0's module buffers, once per buffer dtype (reliability/buffers.py)
        assert step["broadcast"]["calls"] == out["buffer_dtypes"]
        if case.stage == 0:  # DDP: one all-reduce of every gradient (the last with the usage flags), nothing else
            assert step["all_reduce"] == {"calls": buckets, "elements": padded + flags,
                                          "bytes": REDUCE_BYTES * (padded + flags)}
            assert step["reduce_scatter"]["calls"] == step["all_gather"]["calls"] == 0
            continue
        reductions = case.accumulation if case.stage >= 2 and case.reduce_every_micro_step else 1
        reduced = {"calls": reductions * buckets, "elements": reductions * padded,
                   "bytes": reductions * REDUCE_BYTES * padded}
        norm = {"calls": 1, "elements": 1 + flags, "bytes": 8 * (1 + flags)}  # global grad norm + usage (float64)
        if out["reduce_scatter"]:
            assert step["reduce_scatter"] == reduced and step["all_reduce"] == norm
        else:  # each bucket all-reduced whole, the shard kept
            assert step["reduce_scatter"]["calls"] == 0
            assert step["all_reduce"] == {key: reduced[key] + norm[key] for key in norm}
        if case.stage == 3:
            check_stage3_gathers(case, out, step)
            continue
        gathers = 0 if result["skipped"] else 1  # a skipped step changes no parameter: nothing to gather
        assert step["all_gather"] == {"calls": gathers * buckets, "elements": gathers * padded,
                                      "bytes": gathers * DTYPE_BYTES[case.dtype] * padded}


def check_stage3_gathers(case: Case, out: dict, step: dict) -> None:
    """Per micro-step the root is gathered once (it stays for the whole step) and every other unit twice:
    before its forward and before its backward. Nested units too: each gathers only what it owns, and an
    outer unit stays gathered while the units inside it run. Persistent units are gathered after each step.
    A unit's frozen parameters are gathered with it (one padded buffer per unit)."""
    gathered = [t + f for t, f in zip(out["unit_numel"], out["unit_frozen_numel"])]
    root, blocks = gathered[0], gathered[1:]
    if case.reuse_first_block or case.persistence_threshold or case.reverse_on_odd_steps:
        return  # counted by their own tests
    assert step["all_gather"]["elements"] == case.accumulation * (root + 2 * sum(blocks))


def test_stage3_moves_three_psi(parity_runs) -> None:
    """~3Ψ per step (gather for forward, gather for backward, reduce-scatter), 1.5x stage 2; the root
    unit, gathered once for both passes, is what makes it a little less. TinyGPT's frozen layer (the
    root's) is gathered too, once a step, though it is not in Ψ."""
    runs = parity_runs(3)[0]
    stage2 = runs["stage2-fp32-reduce-scatter"]["comm_per_step"][-1]
    stage3 = runs["stage3-fp32-reduce-scatter"]["comm_per_step"][-1]
    psi = runs["stage3-fp32-reduce-scatter"]["layout_numel"]
    moved3 = stage3["all_gather"]["elements"] + stage3["reduce_scatter"]["elements"]
    moved2 = stage2["all_gather"]["elements"] + stage2["reduce_scatter"]["elements"]
    root = runs["stage3-fp32-reduce-scatter"]["unit_numel"][0]
    root_frozen = runs["stage3-fp32-reduce-scatter"]["unit_frozen_numel"][0]
    assert moved3 == 3 * psi - root + root_frozen
    assert 1.3 < moved3 / moved2 <= 1.5


def test_stage3_never_exceeds_the_live_parameter_limit(parity_runs) -> None:
    for name in ("stage3-fp32-live-limit", "stage3-sgd-no-prefetch-room"):
        for runs in parity_runs(3):
            out = runs[name]
            assert out["peak_live_numel"] <= out["case"]["max_live_parameters"]
    unlimited = parity_runs(3)[0]["stage3-fp32"]
    gathered = [t + f for t, f in zip(unlimited["unit_numel"], unlimited["unit_frozen_numel"])]
    assert unlimited["peak_live_numel"] > gathered[0] + max(gathered[1:])  # prefetch


def test_stages_1_and_2_move_what_ddp_moves(parity_runs) -> None:
    """Per rank on a ring: all-reduce sends 2(N-1)/N x Ψ; reduce-scatter + all-gather send
    (N-1)/N x Ψ each: the same 2Ψ elements, up to padding. With gloo's default (the bucket all-reduced,
    the shard kept) a rank sends 3(N-1)/N x Ψ: 1.5x, the price of gloo's slow reduce-scatter."""
    runs = parity_runs(3)[0]
    ddp = runs["stage0-fp32"]["comm_per_step"][-1]["all_reduce"]["elements"] - runs["stage0-fp32"]["trainable_tensors"]
    for stage in (1, 2):
        name = f"stage{stage}-fp32-reduce-scatter"
        step = runs[name]["comm_per_step"][-1]
        sharded = step["reduce_scatter"]["elements"] + step["all_gather"]["elements"]
        assert abs(sharded - 2 * ddp) <= 2 * runs[name]["buckets"] * 3
        default = runs[f"stage{stage}-fp32"]
        assert not default["reduce_scatter"]  # gloo
        step = default["comm_per_step"][-1]
        reduced = step["all_reduce"]["elements"] - 1 - default["trainable_tensors"]  # less the grad norm and flags
        assert abs(reduced - ddp) <= default["buckets"] * 3 and abs(step["all_gather"]["elements"] - ddp) <= default["buckets"] * 3
