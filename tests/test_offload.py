"""Offload tiers hold what they say where they say, and move what they say (issue 10). That each offloaded
run trains like one process is tested in test_parity.py (the offload-* cases)."""

from __future__ import annotations

import pytest
import torch

from conftest import cases_for

BYTES = {"fp32": 4, "bf16": 2}
OFFLOADED = [(n, c) for n in (2, 3) for c in cases_for(n) if c.offload_optimizer == "cpu" and c.offload_ratio == 1
             and c.optimizer == "adamw" and c.offload_param == "none"]


@pytest.mark.parametrize("world_size,case", OFFLOADED, ids=[f"N{n}-{c.name}" for n, c in OFFLOADED])
def test_optimizer_offload_keeps_masters_state_and_gradients_in_host_memory(parity_runs, world_size, case) -> None:
    """Host memory holds the fp32 masters (this rank's shard of every bucket), an fp32 gradient buffer of the
    same size, and AdamW's state; the device holds no optimizer state, and at stages 2-3 no gradient shard once the
    window's last backward has sent each to the host (See [Note: a gradient's copy to the host]; stage 1 keeps its
    full gradient buffer on the device). Every step moves each reduced
    gradient shard to the host once (fp32) and each updated shard back once (in the compute dtype)."""
    for out in (runs[case.name] for runs in parity_runs(world_size)):
        shard = out["local_shard_numel"]
        host, device = out["memory_by_tier"]["host"], out["memory_by_tier"]["device"]
        assert device["optimizer_state"] == 0
        assert host["optimizer_state"] == 4 * shard + 8 * out["stepped_numel"] + 4 * out["optimizer_pieces"]
        assert host["gradients"] == 4 * shard
        at_boundary = out["memory_by_tier_at_boundary"]
        if case.stage >= 2:
            assert (at_boundary["device"]["gradients"], at_boundary["host"]["gradients"]) == (0, 4 * shard)
        for step in out["comm_per_step"][1:]:
            assert step["device_to_host"]["bytes"] == 4 * shard
            assert step["host_to_device"]["bytes"] == BYTES[case.dtype] * shard


PARAMS_OFFLOADED = [(n, c) for n in (2, 3) for c in cases_for(n) if c.offload_param == "cpu"]


@pytest.mark.parametrize("world_size,case", PARAMS_OFFLOADED, ids=[f"N{n}-{c.name}" for n, c in PARAMS_OFFLOADED])
def test_parameter_offload_keeps_shards_in_host_memory_and_copies_each_gather_in(parity_runs, world_size, case) -> None:
    """Between steps the device holds no parameter (no unit is persistent here): every shard, trainable and
    frozen, is in host memory. Each gather first copies this rank's shard to the device: 1/N of what the
    all-gathers bring in."""
    for out in (runs[case.name] for runs in parity_runs(world_size)):
        tiers = out["memory_by_tier"]
        assert tiers["device"]["parameters"] == 0
        shards = BYTES[case.dtype] * (out["local_shard_numel"] + out["frozen_shard_numel"])
        assert tiers["host"]["parameters"] == shards
        published = 0 if case.offload_optimizer == "cpu" else BYTES[case.dtype] * out["local_shard_numel"]
        for step in out["comm_per_step"][1:]:
            assert step["host_to_device"]["bytes"] * world_size == step["all_gather"]["bytes"]
            # masters on the device publish each updated shard across to the host; host masters publish in place
            gradients = 4 * out["local_shard_numel"] if case.offload_optimizer == "cpu" else 0
            assert step["device_to_host"]["bytes"] == published + gradients


# An offloaded run and the same run on another tier: (offloaded case, its twin in the matrix, the stages).
TWINS = [("offload-cpu", "idle-branch", (1, 2, 3)), ("offload-nvme", "idle-branch-accum2", (1, 2, 3)),
         ("offload-nvme-adafactor", "adafactor", (1, 2, 3)), ("offload-params-nvme", "offload-params-cpu", (3,))]


@pytest.mark.parametrize("world_size", [1, 3])  # where the sweep runs offload (See [Note: the sweep's world sizes])
def test_offloaded_runs_equal_the_same_run_without_offload_bit_for_bit(parity_runs, world_size) -> None:
    """Where the masters and shards live changes nothing in the numbers: the same steps on the same values, in
    another memory, give the same losses and parameters to the last bit, at every stage and precision."""
    runs = parity_runs(world_size)[0]
    for offloaded, plain, stages in TWINS:
        for stage in stages:
            for dtype in ("fp32", "bf16"):
                a, b = runs[f"stage{stage}-{dtype}-{offloaded}"], runs[f"stage{stage}-{dtype}-{plain}"]
                assert a["losses"] == b["losses"], (stage, dtype, offloaded)
                assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), (stage, dtype, offloaded)


NVME_PARAMS = [(n, c) for n in (2, 3) for c in cases_for(n) if c.offload_param == "nvme"]


@pytest.mark.parametrize("world_size,case", NVME_PARAMS, ids=[f"N{n}-{c.name}" for n, c in NVME_PARAMS])
def test_nvme_parameters_live_in_files_and_are_read_for_each_gather(parity_runs, world_size, case) -> None:
    """With max_in_cpu elements of host cache, the rest of the shards is on NVMe, read for each gather and
    written when the updated masters are published. Host memory holds the cache and the pool of swap buffers
    (5, the default buffer_count, each one chunk: at most a bucket's shard here, aligned to 4 KiB in an
    allocation 4 KiB larger): see tests/test_offload_memory.py for the pool's exact count."""
    for out in (runs[case.name] for runs in parity_runs(world_size)):
        tiers = out["memory_by_tier"]
        assert tiers["nvme"]["parameters"] > 0 and tiers["device"]["parameters"] == 0
        pool = 5 * (BYTES[case.dtype] * out["local_shard_numel"] + 2 * 4096)
        assert 0 < tiers["host"]["parameters"] <= BYTES[case.dtype] * case.offload_max_in_cpu + pool
        for step in out["comm_per_step"][1:]:
            assert step["nvme_read"]["calls"] > 0 and step["nvme_write"]["calls"] > 0
            assert step["host_to_device"]["bytes"] * world_size == step["all_gather"]["bytes"]
