"""MiCS / HSDP sharding (`zero_optimization.mics_shard_size`, issue 26) on 2 nodes x 2 gloo ranks: stages 1-3 match
one process on the union of the batches (test_parity.py's tolerances), the bytes that cross nodes equal the ring
formula of [Note: bytes that cross nodes] (zerokit/comm/collectives.py), each rank holds 1/s of the optimizer state,
checkpoints go hybrid -> flat and flat -> hybrid, bad sizes are one line, and one real two-node torchrun job.

Simulated nodes: the spawned ranks are told `ranks_per_node: 2` in the config; the torchrun test reads it from
torchrun's LOCAL_WORLD_SIZE. One spawn of 4 ranks runs every case on 4 ranks, one of 2 ranks every flat load.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import zerokit
from test_parity import allowed_update_error, update_error
from zerokit.comm.counting import RING_FACTOR, Collective
from zerokit.config.settings import launcher_node_rank
from zerokit.config.resolve import engine_settings
from zerokit.config.typed import load_config
from zerokit.planner.check import check_rows
from zerokit.planner.device import DeviceProfile
from zerokit.planner.engine_model import EngineSetup, engine_comm, engine_states
from zerokit.planner.engine_offload import engine_transfers
from zerokit.profiling.inventory import param_inventory
from zerokit.reliability.mistakes import refuse_misnumbered_node
from zerokit.testing.parity import (Case, engine_config, forward_loss, make_batch, make_model, make_optimizer,
                                    run_engine, run_reference)
from zerokit.testing.spawn import spawn

NODES = {"ranks_per_node": 2}
SAVED_AFTER, STEPS = 2, 4
MICS = {"mics_shard_size": 2, **NODES}
PARITY = [
    Case("mics-s1", stage=1, steps=3, accumulation=2, **MICS),
    # a layer only rank 0 runs, on odd steps: its shard group uses it, the other does not, so the replicas must
    # agree on which parameters got a gradient (or the second replica would skip a step the first takes)
    Case("mics-s2", stage=2, steps=3, accumulation=2, usage="idle-or-rank0", **MICS),
    Case("mics-s3", stage=3, steps=3, accumulation=2, **MICS),
    Case("mics-s3-bf16", stage=3, dtype="bf16", steps=3, accumulation=2, **MICS),
    Case("mics-s3-offload-cpu", stage=3, steps=2, offload_optimizer="cpu", **MICS),
    # 2**19 overflows at first: every replica must skip the same steps (an inf on one replica reaches the other
    # through the boundary's all-reduce) and halve its scale alike
    Case("mics-s1-fp16-overflowing", stage=1, dtype="fp16", initial_scale_power=19, steps=4, **MICS),
    Case("flat-s3", stage=3, steps=3, accumulation=2, **NODES),  # the same job without MiCS: its bytes cross nodes
    # hpZ: later micro-steps, backward and recomputation gather from the secondary copy inside the node
    Case("hpz-s3", stage=3, steps=3, accumulation=2, hpz_partition_size=2, **NODES),
    Case("hpz-s3-bf16-recompute", stage=3, dtype="bf16", steps=3, accumulation=2, checkpoint_units=True,
         hpz_partition_size=2, **NODES),
]
# The planner's engine model against each rank (steps and usage as test_planner_engine_exact.py's: every
# parameter gets a gradient on the first step, so the optimizer's state is whole by the second)
MODEL_CASES = [replace(case, steps=2, usage="rotating")
               for case in PARITY if case.name in ("mics-s1", "mics-s2", "mics-s3", "flat-s3", "hpz-s3")]
# every parameter is under the threshold, so the root holds them all and stays gathered (17,688 elements): the
# publish's gather of its trainable buckets keeps hpZ's secondary part of them after the step
MODEL_CASES.append(replace(MODEL_CASES[-1], name="hpz-s3-persistent-root", persistence_threshold=20_000))
# shards on NVMe, none cached: only a bucket's first gather of a step reads its shard, later ones the secondary copy
MODEL_CASES.append(replace(MODEL_CASES[-2], name="hpz-s3-params-on-nvme", offload_param="nvme", offload_max_in_cpu=0))
RECORDED = [case for case in MODEL_CASES if case.name in ("mics-s3", "hpz-s3")]
THREE_PER_NODE = [Case("mics-s2-2x3", stage=2, steps=2, accumulation=2, mics_shard_size=3, ranks_per_node=3),
                  Case("hpz-s3-2x3", stage=3, steps=2, accumulation=2, hpz_partition_size=3, ranks_per_node=3)]
HPZ_RESUME = Case("hpz-resume", stage=3, steps=STEPS, hpz_partition_size=2, **NODES)
MEMORY = Case("memory-s1", stage=1, steps=1, **MICS)  # optimizer state: MiCS on 4 ranks vs flat on 2 and on 4
HYBRID_SAVE = Case("save-hybrid-s3", stage=3, steps=STEPS, **MICS)  # saved on 2x2 MiCS, resumed flat on 2 ranks
FLAT_SAVE = Case("save-flat-s2", stage=2, steps=STEPS, **NODES)  # saved flat on 4 ranks, resumed MiCS on 2x2


def build(case: Case) -> zerokit.Engine:
    model = make_model(case)
    return zerokit.initialize(model, make_optimizer(case, model), engine_config(case))


def train(engine: zerokit.Engine, case: Case, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        for micro in range(case.accumulation):
            loss = forward_loss(engine, make_batch(case, step, micro, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def weights(engine: zerokit.Engine) -> dict[str, torch.Tensor]:
    names = {name for name, _ in engine.module.named_parameters()}
    return {name: value for name, value in engine.full_state_dict().items() if name in names}


def resumed(case: Case, directory: Path, rank: int) -> dict:
    """A fresh engine of `case` loads `directory` and trains on to STEPS."""
    engine = build(case)
    engine.load_checkpoint(directory)
    loaded = weights(engine)
    return {"loaded": loaded, "losses": train(engine, case, range(SAVED_AFTER, STEPS), rank), "params": weights(engine)}


def states_and_step(rank: int, case: Case) -> dict:
    """memory_stats() after the last backward of the second optimizer step (the optimizer's state exists) and
    after that step, and the growth of comm_stats() over it: what the planner's engine model predicts."""
    engine = build(case)
    train(engine, case, range(1), rank)
    before = engine.comm_stats()
    for micro in range(case.accumulation):
        engine.backward(forward_loss(engine, make_batch(case, 1, micro, rank)))
        after_backward = engine.memory_stats()
        engine.step()
    after = engine.comm_stats()
    comm = {kind: {key: after[kind][key] - before[kind].get(key, 0) for key in after[kind]} for kind in after}
    return {"after_backward": after_backward, "after_step": engine.memory_stats(), "comm": comm}


def recorded(rank: int, case: Case) -> dict | None:
    """A profile record of a short run of `case` (rank 0's, as record_run keeps it)."""
    from dataclasses import asdict

    from zerokit.profiling.record import record_run

    model = make_model(case)
    optimizer = make_optimizer(case, model)
    engine = zerokit.initialize(model, optimizer, engine_config(case))
    batches = (make_batch(case, step, micro, rank) for step in range(10) for micro in range(case.accumulation))
    record = record_run(engine, batches, forward_loss, optimizer=optimizer, micro_batch=case.micro_batch, seq_len=16,
                        warmup=1, steps=1)
    return asdict(record) if rank == 0 else None


def four_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {"parity": {case.name: run_engine(rank, world_size, case) for case in PARITY}}
    out["model"] = {case.name: states_and_step(rank, case) for case in MODEL_CASES}
    out["record"] = {case.name: recorded(rank, case) for case in RECORDED}
    out["memory"] = {name: run_engine(rank, world_size, case)["memory"]
                     for name, case in (("mics", MEMORY), ("flat", replace(MEMORY, mics_shard_size=-1)))}
    saved = {}
    for case in (HYBRID_SAVE, FLAT_SAVE):
        engine = build(case)
        train(engine, case, range(SAVED_AFTER), rank)
        engine.save_checkpoint(Path(root) / case.name)
        saved[case.name] = weights(engine)
    out["saved"] = saved
    out["flat-to-hybrid"] = resumed(replace(FLAT_SAVE, **MICS), Path(root) / FLAT_SAVE.name, rank)
    out["hpz-resume"] = hpz_resume(rank, Path(root) / HPZ_RESUME.name)
    return out


def hpz_resume(rank: int, directory: Path) -> dict:
    """Save after SAVED_AFTER steps and go on; then, with hpZ's secondary copy filled by an evaluation forward, load
    the save into the same engine and go on again: the two continuations must be equal (a secondary copy kept
    across the load would hold the weights of the end of the first continuation)."""
    case = HPZ_RESUME
    engine = build(case)
    train(engine, case, range(SAVED_AFTER), rank)
    engine.save_checkpoint(directory)
    uninterrupted = train(engine, case, range(SAVED_AFTER, STEPS), rank)
    with torch.no_grad():
        forward_loss(engine, make_batch(case, STEPS, 0, rank))
    kept = sum(part.numel() for part in engine.stage.trainable.secondary.values())
    engine.load_checkpoint(directory)
    return {"uninterrupted": uninterrupted, "resumed": train(engine, case, range(SAVED_AFTER, STEPS), rank),
            "secondary_before_load": kept}


def two_ranks(rank: int, world_size: int, root: str) -> dict:
    flat = replace(HYBRID_SAVE, mics_shard_size=-1, ranks_per_node=None)
    return {"hybrid-to-flat": resumed(flat, Path(root) / HYBRID_SAVE.name, rank),
            "memory": run_engine(rank, world_size, replace(MEMORY, mics_shard_size=-1, ranks_per_node=None))["memory"]}


def six_ranks(rank: int, world_size: int) -> dict:
    return {case.name: run_engine(rank, world_size, case) for case in THREE_PER_NODE}


@pytest.fixture(scope="module")
def three_per_node():
    """2 nodes x 3 ranks: one spawn of 6 ranks on this machine's cores, so a tiny model and two steps."""
    return spawn(six_ranks, 6, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hybrid"))
    return spawn(four_ranks, 4, root, timeout=600), spawn(two_ranks, 2, root, timeout=300), Path(root)


# --- numerics ----------------------------------------------------------------------------------------

def check_against_reference(case: Case, losses_by_rank: list[list[float]], params: dict, ranks_per_step: list[int],
                            first_step: int = 0) -> dict:
    reference = run_reference(case, ranks_per_step[0], ranks_per_step)
    fp32 = case.dtype == "fp32"
    for rank, losses in enumerate(losses_by_rank):
        expected = [loss for step, r, loss in reference["losses"] if r == rank and step >= first_step]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5 if fp32 else 5e-4, atol=0)
    if fp32:
        for name, value in reference["params"].items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=2e-5, msg=name)
    else:
        initial = {name: p.detach().float() for name, p in make_model(case).named_parameters()}
        assert update_error(params, reference["params"], initial) < allowed_update_error(case, 4)
    return reference


@pytest.mark.parametrize("case", PARITY, ids=lambda c: c.name)
def test_mics_matches_one_process(runs, case: Case) -> None:
    """Each rank's losses and the final parameters are one process's on the union of the 4 ranks' batches."""
    out = [r["parity"][case.name] for r in runs[0]]
    reference = check_against_reference(case, [o["losses"] for o in out], out[0]["params"], [4] * case.steps)
    for rank in out:
        assert [result["skipped"] for result in rank["results"]] == reference["skipped"]
    if case.dtype == "fp16":
        assert reference["skipped"][0] and not reference["skipped"][-1]
    for other in out[1:]:  # every rank (both replicas) ends with the same parameters
        for name, value in out[0]["params"].items():
            assert torch.equal(other["params"][name], value), name


# --- bytes -------------------------------------------------------------------------------------------

def crosses(group: str, rank: int) -> bool:
    """Whether `rank`'s ring successor in `group` is on the other node, for nodes {0, 1} | {2, 3}: the MiCS shard
    groups ({0, 1}, {2, 3}) never, the replica groups ({0, 2}, {1, 3}) always, a group of all four ranks from
    ranks 1 (-> 2) and 3 (-> 0)."""
    return {"mics_shard": False, "mics_gather": False, "mics_replica": True, "hpz_gather": False}.get(group,
                                                                                                   rank in (1, 3))


def ring_formula(step: dict, rank: int) -> float:
    total = 0.0
    for key, count in step.items():
        group, _, kind = key.partition(".")
        if kind and count["calls"] and crosses(group, rank):
            size = 2 if group.startswith(("mics_", "hpz_")) else 4
            total += RING_FACTOR[Collective(kind)](size) * count["bytes"]
    return total


@pytest.mark.parametrize("case", PARITY, ids=lambda c: c.name)
def test_cross_node_bytes_follow_the_ring_formula(runs, case: Case) -> None:
    for rank, out in enumerate(r["parity"][case.name] for r in runs[0]):
        for step in out["comm_per_step"]:
            assert step["cross_node"]["bytes"] == round(ring_formula(step, rank)), (rank, step)
        step = out["comm_per_step"][-1]
        if case.mics_shard_size == -1:
            continue
        # once per optimizer step: every reduced shard in fp32, and one float64 flag per trainable tensor
        boundary = out["local_shard_numel"] * 4 + out["trainable_tensors"] * 8
        assert step["mics_replica.all_reduce"]["bytes"] == boundary
        assert step["cross_node"]["bytes"] == boundary  # nothing else crosses: the replica all-reduce is a 2-ring
        assert all(step[f"{group}.{kind.value}"]["bytes"] == 0 for group in ("shard", "gather") for kind in Collective
                   if f"{group}.{kind.value}" in step)


def test_mics_crosses_nodes_far_less_than_flat_stage3(runs) -> None:
    mics = runs[0][1]["parity"]["mics-s3"]["comm_per_step"][-1]["cross_node"]["bytes"]
    flat = runs[0][1]["parity"]["flat-s3"]["comm_per_step"][-1]["cross_node"]["bytes"]
    assert flat > 10 * mics > 0
    assert runs[0][0]["parity"]["flat-s3"]["comm_per_step"][-1]["cross_node"]["bytes"] == 0  # 0 -> 1 stays in node 0


def test_optimizer_state_is_split_over_the_shard_group_only(runs) -> None:
    """MiCS with s=2 on 4 ranks holds, per rank, exactly what flat ZeRO holds on 2 ranks: twice flat ZeRO on 4."""
    for rank in range(4):
        mics = runs[0][rank]["memory"]["mics"]["optimizer_state"]
        assert mics == runs[1][rank % 2]["memory"]["optimizer_state"]
        assert mics > 1.9 * runs[0][rank]["memory"]["flat"]["optimizer_state"]


def test_hpz_gathers_after_the_first_forward_stay_in_the_node(runs) -> None:
    """Per step, hpZ gathers what flat stage 3 gathers, each unit's first gather of the step from the primary shards
    over all ranks and every later one from the secondary copy over the node's 2 ranks, so fewer bytes cross."""
    for rank in range(4):
        hpz = runs[0][rank]["parity"]["hpz-s3"]["comm_per_step"][-1]
        flat = runs[0][rank]["parity"]["flat-s3"]["comm_per_step"][-1]
        primary, secondary = hpz["gather.all_gather"], hpz["hpz_gather.all_gather"]
        assert primary["calls"] + secondary["calls"] == flat["gather.all_gather"]["calls"]
        assert primary["bytes"] + secondary["bytes"] == flat["gather.all_gather"]["bytes"]
        assert secondary["calls"] > primary["calls"] > 0  # 2 micro-steps' forwards and backwards, 1 from primary
        crossing = 0.75 * secondary["bytes"] if rank in (1, 3) else 0  # what a ring over the 4 ranks sends across
        assert hpz["cross_node"]["bytes"] == flat["cross_node"]["bytes"] - crossing


def test_hpz_memory_counts_the_secondary_copy(runs) -> None:
    """After full_state_dict() every bucket was gathered once since the step: each rank keeps 1/2 of every bucket,
    trainable and frozen, beside its 1/4 primary shard."""
    for rank in range(4):
        hpz, flat = runs[0][rank]["parity"]["hpz-s3"], runs[0][rank]["parity"]["flat-s3"]
        gathered = sum(hpz["unit_numel"]) + sum(hpz["unit_frozen_numel"])  # padded elements, fp32
        assert hpz["unit_frozen_numel"] != [0] * len(hpz["unit_frozen_numel"])
        assert hpz["memory"]["parameters"] == flat["memory"]["parameters"] + gathered * 4 // 2


def test_first_loss_after_loading_an_hpz_checkpoint_is_the_uninterrupted_runs(runs) -> None:
    for out in (r["hpz-resume"] for r in runs[0]):
        assert out["secondary_before_load"] > 0  # the evaluation forward filled it: the load had to drop it
        assert out["resumed"] == out["uninterrupted"]


# --- the planner's engine model, rank by rank ---------------------------------------------------------------

def model_setup(case: Case, world: int) -> EngineSetup:
    """The planner's description of `case`'s engine, as profiling/record.py's engine_setup makes it from a real one."""
    return EngineSetup(stage=case.stage, world=world, precision=case.dtype, reduce_dtype=case.dtype,
                       grad_accum=case.accumulation, bucket_bytes=case.bucket_bytes,
                       persistence_threshold=case.persistence_threshold, mics_shard_size=case.mics_shard_size,
                       ranks_per_node=case.ranks_per_node, hpz_partition_size=case.hpz_partition_size,
                       offload_optimizer=case.offload_optimizer, offload_param=case.offload_param,
                       **({} if case.offload_max_in_cpu is None else {"max_in_cpu": case.offload_max_in_cpu}))


def inventory(case: Case):
    model = make_model(case)
    return param_inventory(model, make_optimizer(case, model), load_config(engine_config(case)).stage3)


def moved(stats: dict) -> dict:
    """The entries of a comm_stats() growth that changed (as a profile record keeps them)."""
    return {kind: entry for kind, entry in stats.items() if any(entry.values())}


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_the_planner_predicts_every_ranks_comm_stats_and_memory_stats(runs, case: Case) -> None:
    """Per group, across nodes (which differ by rank), the offload tier's copies, and every memory category, to the
    byte."""
    setup, parts = model_setup(case, 4), inventory(case)
    for rank, out in enumerate(r["model"][case.name] for r in runs[0]):
        predicted = engine_comm(parts, setup, rank)
        assert moved(predicted | engine_transfers(parts, setup, rank)) == moved(out["comm"]), rank
        assert predicted["cross_node"] == out["comm"]["cross_node"], rank  # rank 0's and 2's may be 0: not moved
        if case.offload_param == "nvme":
            continue  # engine_states does not model the NVMe tier's files (records rounded to blocks), flat or hybrid
        states = engine_states(parts, setup, rank)
        assert (states.after_backward, states.after_step) == (out["after_backward"], out["after_step"]), rank


def test_the_planner_predicts_mics_with_optimizer_offload(runs) -> None:
    """The collectives and the offload tier's copies of each rank's last step (the optimizer's state exists)."""
    case = next(case for case in PARITY if case.offload_optimizer == "cpu")
    setup, parts = model_setup(case, 4), inventory(case)
    for rank, out in enumerate(r["parity"][case.name] for r in runs[0]):
        step = moved(out["comm_per_step"][-1])
        transfers = engine_transfers(parts, setup, rank)
        assert transfers and transfers == {kind: step[kind] for kind in transfers}, rank
        assert moved(engine_comm(parts, setup, rank)) == {kind: step[kind] for kind in step if kind not in transfers}


def test_the_model_splits_as_the_engine_does() -> None:
    """The model's own reading of the cases: MiCS's replica all-reduce crosses nodes from every rank, flat stage 3
    only from ranks 1 and 3, hpZ's secondary copy is in the parameters after backward and not after the step."""
    cross = {case.name: [engine_comm(inventory(case), model_setup(case, 4), rank)["cross_node"]["bytes"]
                         for rank in range(4)] for case in MODEL_CASES}
    assert all(cross[name][0] == cross[name][1] > 0 for name in ("mics-s1", "mics-s2", "mics-s3"))
    assert cross["flat-s3"][0] == cross["flat-s3"][2] == 0 < cross["hpz-s3"][1] < cross["flat-s3"][1]
    hpz = next(case for case in MODEL_CASES if case.name == "hpz-s3")
    states = engine_states(inventory(hpz), model_setup(hpz, 4))
    assert states.after_backward["parameters"] > states.after_step["parameters"]


@pytest.mark.parametrize("case", RECORDED, ids=lambda c: c.name)
def test_a_profile_record_of_a_hybrid_run_is_checked_to_the_byte(runs, case: Case) -> None:
    """record_run takes a MiCS or hpZ engine, and `zerokit check`'s rows (check_rows) for its model states and its
    collectives, per kind, per group and across nodes, have no error."""
    record = runs[0][0]["record"][case.name]
    assert record["setup"]["ranks_per_node"] == 2
    rows = {row.category: row for row in check_rows(record)}
    exact = [name for name in rows if not name.startswith(("activations", "peak_", "time.", "cpu_time."))]
    assert "cross_node.bytes" in exact and any(name.startswith(("mics_", "hpz_")) for name in exact)
    assert {name: rows[name].error for name in exact} == dict.fromkeys(exact, 0.0)
    # with a device, the times too: the collectives priced per kind ("cross_node" and the groups' entries apart)
    device = DeviceProfile(name="test", peak_flops={"fp32": 1e11}, memory_bandwidth=1e10, link_bandwidth=1e9,
                           link_latency=1e-5, optimizer_seconds_per_element={"adamw": 1e-9})
    timed = {row.category: row.predicted for row in check_rows(record, device=device)}
    assert timed["time.communication"] > 0 and timed["time.step"] > 0
    # copies of the run (zerokit plan --check --calibrate) are built from the record's config: hybrid as it was
    from zerokit.profiling.record import engine_config as recorded_config

    copy = engine_settings(load_config(recorded_config(record["setup"])), 4, "gloo")
    assert copy == EngineSetup(**record["setup"]).settings
    shard_size = 4 if case.mics_shard_size == -1 else case.mics_shard_size  # -1: one group over every rank
    assert (copy.shard_size, copy.secondary_size, copy.ranks_per_node) == (shard_size, case.hpz_partition_size, 2)


@pytest.mark.parametrize("case", THREE_PER_NODE, ids=lambda c: c.name)
def test_two_nodes_of_three_ranks_match_one_process_and_the_plan(three_per_node, case: Case) -> None:
    """MiCS (s=3) and hpZ (k=3) over nodes {0, 1, 2} | {3, 4, 5}: one process on the union of the 6 ranks' batches,
    and each rank's last step as the planner predicts it. A ring over all 6 ranks sends 5/6 of a size across from
    ranks 2 and 5, which need not be whole bytes: the engine rounds its running total, so a step's growth may
    differ from the rounded prediction by one byte."""
    out = [r[case.name] for r in three_per_node]
    check_against_reference(case, [o["losses"] for o in out], out[0]["params"], [6] * case.steps)
    setup, parts = model_setup(case, 6), inventory(case)
    for rank, step in enumerate(o["comm_per_step"][-1] for o in out):
        predicted = engine_comm(parts, setup, rank)
        assert moved(predicted | {"cross_node": {}}) == moved(step | {"cross_node": {}}), rank  # all but cross_node
        assert abs(predicted["cross_node"]["bytes"] - step["cross_node"]["bytes"]) <= 1, rank
        if case.mics_shard_size == 3 or rank % 3 != 2:  # the 2-rank replica rings are whole bytes, nothing else crosses
            assert predicted["cross_node"] == step["cross_node"], rank
    crossing = [engine_comm(parts, setup, rank)["cross_node"]["bytes"] > 0 for rank in range(6)]
    assert crossing == ([True] * 6 if case.mics_shard_size == 3 else [False, False, True] * 2)


# --- checkpoints ---------------------------------------------------------------------------------------

def test_hybrid_checkpoint_resumes_flat_on_two_ranks(runs) -> None:
    saved = runs[0][0]["saved"][HYBRID_SAVE.name]
    out = [r["hybrid-to-flat"] for r in runs[1]]
    for rank in out:
        for name, value in saved.items():
            assert torch.equal(rank["loaded"][name], value), name  # what replica 0 wrote is what every rank held
    check_against_reference(HYBRID_SAVE, [o["losses"] for o in out], out[0]["params"],
                            [4] * SAVED_AFTER + [2] * (STEPS - SAVED_AFTER), first_step=SAVED_AFTER)


def test_flat_checkpoint_resumes_hybrid(runs) -> None:
    saved = runs[0][0]["saved"][FLAT_SAVE.name]
    out = [r["flat-to-hybrid"] for r in runs[0]]
    for rank in out:
        for name, value in saved.items():
            assert torch.equal(rank["loaded"][name], value), name
    check_against_reference(FLAT_SAVE, [o["losses"] for o in out], out[0]["params"], [4] * STEPS,
                            first_step=SAVED_AFTER)


def test_a_hybrid_checkpoint_converts_to_deepspeeds_universal_layout(runs, tmp_path) -> None:
    """`zerokit convert --to deepspeed-universal` of the MiCS save (replica 0 alone wrote its shards) writes every
    parameter whole, as every rank held it, with its step count. (Real DeepSpeed resuming such a conversion, at
    stages 2 and 3 on 4 ranks, is tests/test_deepspeed_export.py's path: not repeated here.)"""
    from zerokit.checkpoint.deepspeed_export import convert_to_universal

    converted = convert_to_universal(runs[2] / HYBRID_SAVE.name, tmp_path / "universal")
    saved = runs[0][0]["saved"][HYBRID_SAVE.name]
    trainable = [name for name, param in make_model(HYBRID_SAVE).named_parameters() if param.requires_grad]
    assert converted.params == len(trainable) < len(saved)  # and the frozen ones, without optimizer state
    for name, value in saved.items():
        folder = converted.out / converted.tag / "zero" / name
        assert torch.equal(torch.load(folder / "fp32.pt")["param"], value), name
    for name in trainable:
        assert torch.equal(torch.load(converted.out / converted.tag / "zero" / name / "step.pt"),
                           torch.tensor(float(SAVED_AFTER))), name


# --- bad input -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero, top, message", [
    ({"stage": 3, "mics_shard_size": 3}, {}, r"^zero_optimization.mics_shard_size=3 does not divide the world size 4"),
    ({"stage": 2, "mics_shard_size": 0}, {}, r"^zero_optimization.mics_shard_size=0 is not a shard group size"),
    ({"stage": 0, "mics_shard_size": 2}, {}, r"^zero_optimization.mics_shard_size=2 needs stage 1, 2 or 3"),
    ({"stage": 1}, {"ranks_per_node": 0}, r"^ranks_per_node=0 must be a positive rank count"),
    ({"stage": 1}, {"ranks_per_node": 3}, r"^ranks_per_node=3 does not divide the world size 4"),
    ({"stage": 3, "zero_hpz_partition_size": 3}, {}, r"^zero_optimization.zero_hpz_partition_size=3 does not divide"),
    ({"stage": 3, "zero_hpz_partition_size": 2, "mics_shard_size": 2}, {},
     r"^zero_optimization.zero_hpz_partition_size=2 needs stage 3 without mics_shard_size"),
    ({"stage": 3, "zero_hpz_partition_size": 0}, {}, r"^zero_optimization.zero_hpz_partition_size=0 is not a group size"),
])
def test_bad_shard_sizes_are_named_in_one_line(zero, top, message) -> None:
    with pytest.raises(ValueError, match=message) as error:
        engine_settings(load_config({"zero_optimization": zero, **top}), 4, "gloo")
    assert "\n" not in str(error.value)


def test_settings_resolve_the_groups(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    settings = engine_settings(load_config({"zero_optimization": {"stage": 3, "mics_shard_size": 4}}), 8, "gloo")
    assert (settings.shard_size, settings.replicas, settings.ranks_per_node, settings.layout_world_size) == (4, 2, 4, 4)
    flat = engine_settings(load_config({"zero_optimization": {"stage": 3}}), 8, "gloo")
    assert (flat.shard_size, flat.replicas, flat.nodes) == (8, 1, 2)
    config = load_config({"zero_optimization": {"stage": 3, "mics_hierarchical_params_gather": True}})
    assert any("mics_hierarchical_params_gather" in line for line in config.notes)  # accepted and logged


def test_a_node_numbered_out_of_order_is_named(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "0")
    refuse_misnumbered_node(2, launcher_node_rank(), 1)
    with pytest.raises(ValueError, match=r"^rank 2 runs on node 0 \(torchrun's GROUP_RANK\) but"):
        refuse_misnumbered_node(2, launcher_node_rank(), 2)
    refuse_misnumbered_node(2, None, 2)  # the nodes are not torchrun's: nothing to check


# --- two real torchrun nodes ---------------------------------------------------------------------------------

SCRIPT = Path(__file__).parent / "scripts" / "hybrid_node.py"
TORCHRUN_CASE = Case("torchrun-s3", stage=3, steps=2, accumulation=2, mics_shard_size=2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_torchrun_nodes(tmp_path) -> None:
    """torchrun --nnodes 2 twice on this machine: nodes come from LOCAL_WORLD_SIZE/GROUP_RANK, not the config."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "--max_restarts", "0", str(SCRIPT), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    errors = sorted(tmp_path.glob("error_*.txt"))
    assert not errors, errors[0].read_text()
    assert all(node.returncode == 0 for node in nodes), outputs[0][-3000:] + outputs[1][-3000:]
    out = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in range(4)]
    assert [o["node"] for o in out] == [0, 0, 1, 1]
    assert all(o["settings"] == {"shard_size": 2, "replicas": 2, "ranks_per_node": 2} for o in out)
    params = {name: torch.tensor(value) for name, value in out[0]["params"].items()}
    check_against_reference(TORCHRUN_CASE, [o["losses"] for o in out], params, [4] * TORCHRUN_CASE.steps)
    assert all(o["cross_node"] == o["replica_bytes"] > 0 for o in out)


def model_ranks(rank: int, world_size: int, names: list[str]) -> dict:
    return {case.name: states_and_step(rank, case) for case in MODEL_CASES if case.name in names}


def print_prediction_table(names: list[str]) -> None:
    """Each rank's measured comm_stats() growth over a step and memory_stats(), beside the planner's prediction:
    `python tests/test_hybrid.py mics-s3 hpz-s3` (any of MODEL_CASES' names)."""
    measured = spawn(model_ranks, 4, names, timeout=600)
    for case in (case for case in MODEL_CASES if case.name in names):
        setup, parts = model_setup(case, 4), inventory(case)
        print(f"\n{case.name}: {'rank':>4}  {'entry':<38} {'predicted':>26} {'measured':>26}")
        for rank in range(4):
            out, states = measured[rank][case.name], engine_states(parts, setup, rank)
            predicted = engine_comm(parts, setup, rank) | engine_transfers(parts, setup, rank)
            rows = [(kind, predicted.get(kind), out["comm"].get(kind))
                    for kind in sorted(moved(out["comm"]) | {"cross_node": {}})]
            rows += [(f"memory.{when}.{name}", getattr(states, when)[name], out[when][name])
                     for when in ("after_backward", "after_step") for name in out[when]]
            for entry, plan, seen in rows:
                show = [str(tuple(v.values()) if isinstance(v, dict) else v) for v in (plan, seen)]
                print(f"{'':{len(case.name) + 1}} {rank:>4}  {entry:<38} {show[0]:>26} {show[1]:>26}"
                      f"{'' if plan == seen else '  <- differs'}")


if __name__ == "__main__":
    print_prediction_table(sys.argv[1:] or ["mics-s3"])
