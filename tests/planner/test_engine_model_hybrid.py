"""The planner's exact engine model of hybrid sharding (issue 26), without torch: MiCS (`mics_shard_size`) and hpZ
(`zero_hpz_partition_size`) against hand counts on a four-parameter inventory, per rank. tests/test_hybrid.py holds
the same model against real gloo ranks.

The inventory: the root unit holds `c` (5 elements), unit 1 holds `a` (10) and `b` (7) and the frozen `d` (6); one
param group; fp32, AdamW, no buffers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from zerokit.planner.engine_model import (EngineSetup, ParamEntry, ParamInventory, engine_buckets, engine_comm,
                                          engine_states, wire_bytes)
from zerokit.planner.engine_offload import engine_transfers

INVENTORY = ParamInventory((ParamEntry("a", 10, 0, 1), ParamEntry("b", 7, 0, 1), ParamEntry("c", 5, 0, 0),
                            ParamEntry("d", 6, -1, 1, trainable=False)))
NODES = {"ranks_per_node": 2}


def setup(stage: int, world: int = 4, **extra) -> EngineSetup:
    return EngineSetup(stage=stage, world=world, grad_accum=2, **{"persistence_threshold": 0, **extra})


def test_mics_pads_buckets_to_the_shard_group_not_the_world() -> None:
    """Stage 3, s=2 of 4 ranks: unit 1's bucket of 17 elements pads to 18 (not 20), the root's 5 to 6."""
    buckets = engine_buckets(INVENTORY, setup(3, mics_shard_size=2, **NODES))
    assert [(b.unit, b.numel, b.shard_numel) for b in buckets] == [(0, 6, 3), (1, 18, 9)]  # backward order
    flat = engine_buckets(INVENTORY, setup(3, **NODES))
    assert [(b.unit, b.numel, b.shard_numel) for b in flat] == [(0, 8, 2), (1, 20, 5)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mics_holds_per_rank_what_flat_zero_holds_on_the_shard_group(stage: int) -> None:
    """Rank r of 4 with s=2 holds what rank r % 2 of 2 holds: optimizer state (and the rest) split over s, not N."""
    for rank in range(4):
        mics = engine_states(INVENTORY, setup(stage, mics_shard_size=2, **NODES), rank)
        assert mics == engine_states(INVENTORY, setup(stage, world=2), rank % 2)
    assert engine_states(INVENTORY, setup(stage, mics_shard_size=2, **NODES), 0).after_step["optimizer_state"] > \
        engine_states(INVENTORY, setup(stage, **NODES), 0).after_step["optimizer_state"]


def test_mics_stage3_collectives_by_group_and_across_nodes() -> None:
    """2 micro-steps. In the shard group: each of 2 buckets reduced per micro-step (2 x (18 + 6) elements) and the
    norm with 3 usage flags (4 float64); stage 3's gathers: the root's 6 once per micro-step, unit 1's 18 and its
    frozen 6 before forward and backward. Across the replicas, once: each shard (3 + 9) and the 3 flags (float64),
    which is all that crosses nodes: a 2-ring all-reduce sends its whole size, from every rank."""
    expected = {
        "mics_shard.all_reduce": {"calls": 5, "elements": 52, "bytes": 48 * 4 + 4 * 8},
        "mics_replica.all_reduce": {"calls": 3, "elements": 15, "bytes": 12 * 4 + 3 * 8},
        "mics_gather.all_gather": {"calls": 10, "elements": 108, "bytes": 108 * 4},
        "all_reduce": {"calls": 8, "elements": 67, "bytes": 224 + 72},
        "all_gather": {"calls": 10, "elements": 108, "bytes": 432},
        "cross_node": {"bytes": 72},
    }
    for rank in range(4):
        assert engine_comm(INVENTORY, setup(3, mics_shard_size=2, **NODES), rank) == expected
    # on a ring of each group: the shard groups' 2-rings send 1/2 (all-reduce 2 x 1/2), the replicas' 2-ring too
    assert wire_bytes(expected, setup(3, mics_shard_size=2, **NODES)) == {"all_reduce": 224 + 72, "all_gather": 216}


def test_flat_stage3_over_two_nodes_crosses_from_ranks_1_and_3_only() -> None:
    """Ring 0 -> 1 -> 2 -> 3 -> 0 over nodes {0, 1} | {2, 3}: ranks 1 and 3 send their whole ring share across.
    Reductions 2 x (8 + 20) fp32 and the norm's 4 float64: 256 bytes x 2 x 3/4; gathers 2 x 8 + 4 x (20 + 8): 128
    elements, 512 bytes x 3/4."""
    cross = [engine_comm(INVENTORY, setup(3, **NODES), rank)["cross_node"]["bytes"] for rank in range(4)]
    assert cross == [0, 384 + 384, 0, 384 + 384]
    assert engine_comm(INVENTORY, setup(3, **NODES), 1)["shard.all_reduce"]["bytes"] == 256


def test_hpz_gathers_each_bucket_once_from_the_primary_shards_per_step() -> None:
    """k=2: the root's bucket (8), unit 1's (20) and its frozen one (8) each come once over all 4 ranks; the root's
    second micro-step and unit 1's three later gathers read the secondary copy over the node's 2 ranks."""
    hpz = engine_comm(INVENTORY, setup(3, hpz_partition_size=2, **NODES), 1)
    assert hpz["gather.all_gather"] == {"calls": 3, "elements": 36, "bytes": 144}
    assert hpz["hpz_gather.all_gather"] == {"calls": 7, "elements": 8 + 3 * (20 + 8), "bytes": 92 * 4}
    assert hpz["all_gather"] == engine_comm(INVENTORY, setup(3, **NODES), 1)["all_gather"]
    assert hpz["cross_node"] == {"bytes": 384 + 144 * 3 // 4}  # the node groups never cross


def test_hpz_secondary_copy_in_the_parameters() -> None:
    """After backward every bucket gathered this step keeps 1/2 of itself: (8 + 20 + 8) / 2 elements, fp32. The
    step drops them; only a persistent unit's trainable bucket, gathered again by the publish, keeps one after it."""
    flat = engine_states(INVENTORY, setup(3, **NODES))
    hpz = engine_states(INVENTORY, setup(3, hpz_partition_size=2, **NODES))
    assert hpz.after_backward["parameters"] == flat.after_backward["parameters"] + 18 * 4
    assert hpz.after_step == flat.after_step
    kept = {"persistence_threshold": 10, **NODES}  # the root (8 gathered) stays gathered
    flat = engine_states(INVENTORY, setup(3, **kept))
    hpz = engine_states(INVENTORY, setup(3, hpz_partition_size=2, **kept))
    assert hpz.after_backward["parameters"] == flat.after_backward["parameters"] + 18 * 4
    assert hpz.after_step["parameters"] == flat.after_step["parameters"] + 4 * 4


def test_one_node_splits_nothing() -> None:
    """Without ranks_per_node (every rank on one node) comm_stats() has no "<group>.<kind>" and no "cross_node"."""
    stats = engine_comm(INVENTORY, setup(3, mics_shard_size=2))
    assert set(stats) == {"all_reduce", "all_gather"}


@pytest.mark.parametrize("extra, message", [
    ({"mics_shard_size": 3}, r"^zero_optimization.mics_shard_size=3 does not divide the world size 4"),
    ({"hpz_partition_size": 3}, r"^zero_optimization.zero_hpz_partition_size=3 does not divide the world size 4"),
    ({"ranks_per_node": 3}, r"^ranks_per_node=3 does not divide the world size 4"),
])
def test_bad_hybrid_sizes_are_the_engines_one_line_errors(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        setup(3, **extra)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("offload", [{"offload_optimizer": "nvme"}, {"offload_param": "nvme", "max_in_cpu": 0}])
def test_mics_offload_copies_are_flat_zeros_on_the_shard_group(offload: dict) -> None:
    """The offload tier holds this rank's shards: rank r of 4 with s=2 copies what rank r % 2 of 2 copies (its
    optimizer records and, with parameters on NVMe, its trainable and frozen shards, in 1/s). The inventory's sizes
    x 10,000, so that a record's state is more than the 4 KiB block NVMe records round to."""
    large = ParamInventory(tuple(replace(entry, numel=entry.numel * 10_000) for entry in INVENTORY.entries))
    for rank in range(4):
        mics = engine_transfers(large, setup(3, mics_shard_size=2, **NODES, **offload), rank)
        assert mics and mics == engine_transfers(large, setup(3, world=2, **offload), rank % 2), rank
