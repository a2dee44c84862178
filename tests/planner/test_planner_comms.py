"""Communication per step: volumes per stage, ring factors, latency, links, hybrid layouts."""

from __future__ import annotations

import pytest

from zerokit.planner import Layout, estimate, make_scenario
from zerokit.planner.comms import ring_steps, wire_factor

P13 = 13_015_864_320  # Llama-2-13B
# the stage-3 root unit, gathered once per micro-step: embedding, head and final norm (327,685,120) and every
# block's two RMSNorm weights (40 x 2 x 5,120), which join the root for being under the persistence threshold
ROOT13 = 327_685_120 + 40 * 2 * 5_120


def comm(model="llama2-13b", stage=3, **kwargs):
    kwargs.setdefault("seq_len", 4096)
    return estimate(make_scenario(model, **kwargs), stage).comm


def test_ring_factors():
    assert wire_factor("all_reduce", 8) == 2 * 7 / 8 and ring_steps("all_reduce", 8) == 14
    assert wire_factor("reduce_scatter", 8) == 7 / 8 and ring_steps("all_gather", 8) == 7
    assert wire_factor("all_gather", 1) == 0


@pytest.mark.parametrize("stage, expected", [
    # elements per optimizer step, one micro-step: stage 0 all-reduce P; stages 1-2 reduce-scatter P and
    # all-gather P; stage 3 all-gather P for forward and P less the root for backward, reduce-scatter P.
    (0, {"all_reduce": P13}),
    (1, {"reduce_scatter": P13, "all_gather": P13, "all_reduce": 1}),  # + the gradient norm, one float64 scalar
    (2, {"reduce_scatter": P13, "all_gather": P13, "all_reduce": 1}),
    (3, {"reduce_scatter": P13, "all_gather": 2 * P13 - ROOT13, "all_reduce": 1}),
])
def test_elements_per_stage_in_engine_units(stage, expected):
    stats = comm(stage=stage).by_kind()
    assert {kind: entry["elements"] for kind, entry in stats.items()} == expected
    assert set(next(iter(stats.values()))) == {"calls", "elements", "bytes"}  # engine.comm_stats() keys


def test_stage3_moves_one_and_a_half_times_stage2():
    """ZeRO paper Section 7: 3 Psi vs 2 Psi when gradients and parameters travel in the same dtype, less
    the root unit's second gather: 1.5 - 328,094,720 / (2 x 13,015,864,320) = 1.4874."""
    stage2 = comm(stage=2, reduce_dtype="bf16")
    stage3 = comm(stage=3, reduce_dtype="bf16")
    assert stage3.wire_bytes / stage2.wire_bytes == pytest.approx(1.5 - ROOT13 / (2 * P13), rel=1e-9)
    bare2, bare3 = comm(13e9, stage=2, reduce_dtype="bf16"), comm(13e9, stage=3, reduce_dtype="bf16")
    assert bare3.wire_bytes / bare2.wire_bytes == pytest.approx(1.5, rel=1e-9)  # no shapes, no root


def test_bytes_follow_the_dtypes():
    stats = comm(stage=3).by_kind()  # default: bf16 parameters, fp32 gradient reduction
    assert stats["all_gather"]["bytes"] == 2 * (2 * P13 - ROOT13)  # two gathers of 2-byte parameters
    assert stats["reduce_scatter"]["bytes"] == 4 * P13


def test_stage3_time_by_hand():
    """Forward all-gather, 8 A100s on NVLink 3: wire 7/8 x 2 x 13,015,864,320 = 22,777,762,560 bytes at
    300 GB/s x 0.8 = 240 GB/s -> 0.094907 s, plus 41 calls (the root and 40 blocks) x 7 ring steps x
    1.5 us = 0.000431 s."""
    forward = next(c for c in comm(stage=3).collectives if c.phase == "forward")
    assert forward.calls == 41 and forward.wire_bytes == 22_777_762_560
    assert forward.seconds == pytest.approx(22_777_762_560 / 240e9 + 41 * 7 * 1.5e-6, rel=1e-12)


def test_gradient_accumulation_cadence():
    """m = 4 micro-steps: stage 0/1 reduce once per step, stage 2 (default) and 3 every micro-step."""
    per = {s: comm(stage=s, grad_accum=4).by_kind() for s in (0, 1, 2, 3)}
    assert per[0]["all_reduce"]["elements"] == P13
    assert per[1]["reduce_scatter"]["elements"] == P13
    assert per[2]["reduce_scatter"]["elements"] == 4 * P13
    assert per[3]["all_gather"]["elements"] == 4 * (2 * P13 - ROOT13)
    once = comm(stage=2, grad_accum=4, reduce_every_micro_step=False).by_kind()
    assert once["reduce_scatter"]["elements"] == P13


def test_inter_node_link_and_bandwidth_per_gpu():
    """2 nodes x 8 A100s, flat ZeRO over 16: the one ring crosses each node boundary once, so it gets the node's
    8 HDR ports, min(NVLink 300, 8 x 25) = 200 GB/s x 0.8 = 160 GB/s (See [Note: communication model]; it was
    the per-GPU share, 20 GB/s); all-gather wire 15/16 x 2 x 13e9 = 24,375,000,000 bytes."""
    forward = next(c for c in comm(13e9, stage=3, nodes=2).collectives if c.phase == "forward")
    assert forward.link == "InfiniBand HDR 200 Gb/s" and forward.group_size == 16
    buckets = -(-13 * 10**9 // (25 * 2**20 // 4))  # a bare count gathers in 25 MiB / 4-byte buckets
    assert forward.seconds == pytest.approx(24_375_000_000 / 160e9 + buckets * 15 * 5e-6, rel=1e-12)


def test_fewer_nics_share_the_bandwidth():
    many = next(c for c in comm(13e9, stage=3, nodes=2).collectives if c.phase == "forward")
    one = next(c for c in comm(13e9, stage=3, nodes=2, nics_per_node=1).collectives if c.phase == "forward")
    latency = many.calls * 15 * 5e-6  # the same rings, so the same latency term
    assert one.seconds - latency == pytest.approx(8 * (many.seconds - latency))  # 1/8 of the node's NIC bandwidth


def test_hsdp_reduce_scatters_in_node_and_all_reduces_shards_across():
    """2 nodes, shard 8 inside each, 2 replicas: reduce-scatter over 8 on NVLink, then an all-reduce of
    each shard, P / 8 elements, over the 2 replicas on InfiniBand."""
    collectives = comm(stage=3, nodes=2, replicas=2).collectives
    rs = next(c for c in collectives if c.kind == "reduce_scatter")
    ar = next(c for c in collectives if c.kind == "all_reduce" and c.group == "dp_replicate")
    assert (rs.group_size, rs.link) == (8, "NVLink 3")
    assert (ar.group_size, ar.link, ar.elements) == (2, "InfiniBand HDR 200 Gb/s", P13 // 8)


def test_tensor_and_pipeline_parallel_traffic():
    """tp = 8: 4 all-reduces of s b h per block (2 forward, 2 backward) -> 4 x 40 calls of 4096 x 5120;
    pp = 2: one activation forward and one gradient back per micro-batch, 4096 x 5120 elements each; a GPU of the
    first stage sends the activation, one of the last the gradient: one of them per GPU on average, 2(p-1)/p."""
    tp = comm(stage=1, nodes=2, tp=8).collectives
    tensor = next(c for c in tp if c.group == "tp")
    assert (tensor.calls, tensor.elements, tensor.link) == (160, 160 * 4096 * 5120, "NVLink 3")
    pp = comm(stage=1, nodes=2, pp=2).collectives
    pipe = next(c for c in pp if c.kind == "send_recv")
    assert (pipe.calls, pipe.elements, pipe.wire_bytes) == (2, 4096 * 5120, 4096 * 5120 * 2)


def test_no_data_parallel_traffic_on_one_gpu():
    assert comm(stage=0, gpus_per_node=1).per_step() == ()


def test_exposed_communication_by_hand():
    """Stage 1: the reduce-scatter overlaps the backward (hidden), the all-gather after the step is not."""
    result = estimate(make_scenario("llama2-13b", seq_len=4096), 1)
    after = sum(c.seconds for c in result.comm.collectives if c.phase == "after_step")
    assert result.exposed_comm_seconds == pytest.approx(after + max(
        sum(c.seconds for c in result.comm.collectives if c.phase == "boundary") - result.compute.backward_seconds,
        sum(c.seconds for c in result.comm.collectives if c.phase == "boundary") / 1987))


def test_layout_must_fit_the_world():
    with pytest.raises(ValueError, match="world size 16 does not fit the layout tp=3"):
        make_scenario("llama2-13b", nodes=2, tp=3)
    with pytest.raises(ValueError, match="tp=16 does not divide 40 attention heads"):
        make_scenario("llama2-13b", nodes=2, tp=16)
    assert Layout(replicas=2).dp_shard(16) == 8
