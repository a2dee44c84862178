"""Compute and offload time: FLOPs per token, MFU, CPU optimizer roofline, PCIe and NVMe."""

from __future__ import annotations

import pytest

from zerokit.planner import Offload, estimate, make_scenario
from zerokit.planner.compute import cpu_update_bytes, flops_per_token
from zerokit.planner.models import param_counts, preset
from zerokit.planner.spec import Trainable, Training

MATMUL_13B = 40 * 317_204_480 + 32_000 * 5_120  # blocks + output projection = 12,852,019,200
ATTENTION_13B = 4 * 40 * 5_120 * 4_096  # 4 L q s = 3,355,443,200 per token in forward


def test_flops_per_token_by_hand():
    """PaLM: 6N + 12 L q s. Forward 2 x 12,852,019,200 + 3,355,443,200 = 29,059,481,600;
    backward twice that = 58,118,963,200; total 87,178,444,800."""
    model = preset("llama2-13b")
    forward, backward = flops_per_token(model, param_counts(model, Trainable()), Training(seq_len=4096))
    assert forward == 2 * MATMUL_13B + ATTENTION_13B == 29_059_481_600
    assert backward == 2 * forward
    assert forward + backward == 6 * MATMUL_13B + 12 * 40 * 5_120 * 4_096


def test_checkpointing_adds_one_forward():
    model = preset("llama2-13b")
    plain = sum(flops_per_token(model, param_counts(model, Trainable()), Training(seq_len=4096)))
    recomputed = sum(flops_per_token(model, param_counts(model, Trainable()), Training(seq_len=4096,
                                                                                       checkpointing="full")))
    assert recomputed == pytest.approx(plain * 4 / 3)


def test_frozen_weights_skip_weight_gradients():
    """Half trainable: backward = 2N (activation grads) + 2 x N/2 (weight grads) + 8 L q s."""
    model = preset("llama2-13b")
    forward, backward = flops_per_token(model, param_counts(model, Trainable(fraction=0.5)), Training(seq_len=4096))
    assert backward == pytest.approx(2 * MATMUL_13B + MATMUL_13B + 2 * ATTENTION_13B)


def test_compute_time_by_hand():
    """87,178,444,800 FLOP x 4,096 tokens / (312 TFLOPS x 0.40) = 2.8612 s per step."""
    result = estimate(make_scenario("llama2-13b", seq_len=4096), 3)
    assert result.compute.seconds == pytest.approx(87_178_444_800 * 4096 / (312e12 * 0.4))
    assert result.compute.forward_seconds == pytest.approx(result.compute.seconds / 3)


def test_tensor_parallel_splits_compute_and_pipeline_adds_a_bubble():
    base = estimate(make_scenario("llama2-13b", seq_len=4096, nodes=2), 1).compute.seconds
    tp = estimate(make_scenario("llama2-13b", seq_len=4096, nodes=2, tp=8), 1).compute.seconds
    assert tp == pytest.approx(base / 8)
    pp = estimate(make_scenario("llama2-13b", seq_len=4096, nodes=2, pp=2, grad_accum=4), 1).compute
    assert pp.bubble == pytest.approx((2 - 1) / (4 + 2 - 1))  # (p - 1) / (m + p - 1) = 0.2
    assert pp.seconds == pytest.approx(4 * base / 2 / (1 - 0.2))


def test_cpu_update_bytes():
    assert cpu_update_bytes(Training()) == 2 * 12 + 4 + 2 == 30  # mixed Adam
    # fp32 Adam: the host keeps its own fp32 master beside m and v (it never reuses the device's parameter),
    # reads and writes all three, reads the gradient and writes the updated 4-byte parameter shard
    assert cpu_update_bytes(Training(precision="fp32")) == 2 * (8 + 4) + 4 + 4 == 32


def test_cpu_optimizer_offload_time_by_hand():
    """ZeRO-2 + optimizer on the CPU of a DGX A100, 13,015,864,320 parameters:
    CPU step 13,015,864,320 x 30 bytes / (409.6 GB/s x 0.8) = 1.19163 s;
    PCIe per GPU at 31.5 GB/s x 0.8 = 25.2 GB/s: down the fp32 reduced shard 4 x P / 8 = 6,507,932,160
    bytes, up the bf16 shard 2 x P / 8 = 3,253,966,080 bytes."""
    result = estimate(make_scenario("llama2-13b", seq_len=4096), 2, Offload(optimizer="cpu"))
    o = result.offload_time
    assert o.cpu_optimizer_seconds == pytest.approx(13_015_864_320 * 30 / (409.6e9 * 0.8))
    assert (o.pcie_down, o.pcie_up) == (6_507_932_160, 3_253_966_080)
    assert o.pcie_seconds == pytest.approx((6_507_932_160 + 3_253_966_080) / 25.2e9)
    down_hidden = max(0.0, 6_507_932_160 / 25.2e9 - result.compute.backward_seconds)
    assert o.exposed_seconds == pytest.approx(down_hidden + o.cpu_optimizer_seconds + 3_253_966_080 / 25.2e9)
    assert result.compute.optimizer_seconds == 0  # the GPU does not step


def test_nvme_offload_traffic_by_hand():
    """Optimizer on NVMe: each node reads and writes its 12 x P bytes of state once per step over
    8 drives at 6.4 / 3.8 GB/s each (x 0.8)."""
    result = estimate(make_scenario(13e9), 3, Offload(optimizer="nvme"))
    state = 12 * 13e9
    assert result.offload_time.nvme_read == result.offload_time.nvme_write == state
    assert result.offload_time.nvme_seconds == pytest.approx(state / (8 * 6.4e9 * 0.8) + state / (8 * 3.8e9 * 0.8))


def test_parameter_offload_fetches_twice_per_micro_step():
    result = estimate(make_scenario(13e9), 3, Offload(optimizer="cpu", params="cpu"))
    shard = 13e9 / 8
    # forward + backward fetch (a bare parameter count has no root unit); the update is written where the
    # parameter shards live, on the host, so nothing else goes up
    assert result.offload_time.pcie_up == 2 * shard * 2


def test_step_time_adds_the_exposed_parts():
    result = estimate(make_scenario("llama2-13b", seq_len=4096), 1)
    assert result.step_seconds == pytest.approx(result.compute.seconds + result.compute.optimizer_seconds
                                                + result.exposed_comm_seconds)
    assert result.tokens_per_second == pytest.approx(8 * 4096 / result.step_seconds)
