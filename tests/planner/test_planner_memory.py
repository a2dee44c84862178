"""Memory per rank: each formula against a hand calculation written out in the test."""

from __future__ import annotations

import math

import pytest

from zerokit.planner import Layout, Offload, estimate, make_scenario
from zerokit.planner.memory import (
    activation_bytes,
    block_activation_bytes,
    buffer_bytes,
    host_usage,
    optimizer_state_bytes,
)
from zerokit.planner.models import Architecture, from_architecture, preset
from zerokit.planner.spec import Assumptions, Trainable, Training

GB = 10**9


def states(params, stage, gpus_per_node=8, nodes=1, **training):
    scenario = make_scenario(params, gpu="a100-80gb", gpus_per_node=gpus_per_node, nodes=nodes, **training)
    return estimate(scenario, stage).memory


@pytest.mark.parametrize("stage, expected", [
    (0, (2 + 2 + 12) * 7.5e9),                       # baseline: 16 bytes x 7.5B = 120 GB
    (1, 2 * 7.5e9 + 2 * 7.5e9 + 12 * 7.5e9 / 64),    # P_os: 15 + 15 + 1.40625 = 31.40625 GB
    (2, 2 * 7.5e9 + (2 + 12) * 7.5e9 / 64),          # P_os+g: 15 + 1.640625 = 16.640625 GB
    (3, (2 + 2 + 12) * 7.5e9 / 64),                  # P_os+g+p: 1.875 GB
])
def test_zero_paper_figure_1(stage, expected):
    """ZeRO paper (Rajbhandari et al. 2019) Figure 1: Psi = 7.5B, N_d = 64, K = 12, and, as in the paper,
    16-bit gradients throughout (reduce dtype bf16). At stage 3 zerokit holds the paper's figure less the 16-bit
    parameter shard, which it does not keep beside the fp32 master (See `no_16bit_shard`)."""
    memory = states(7.5e9, stage, gpus_per_node=8, nodes=8, reduce_dtype="bf16")
    assert memory.model_states + no_16bit_shard(7.5e9, stage, 64) == expected
    assert round((memory.model_states + no_16bit_shard(7.5e9, stage, 64)) / GB, 1) == {0: 120.0, 1: 31.4, 2: 16.6,
                                                                                       3: 1.9}[stage]


def no_16bit_shard(params: float, stage: int, n_d: int) -> float:
    """What the paper counts at stage 3 and zerokit does not hold: the 16-bit copy of the parameter shard (2 bytes a
    parameter over N_d), as zerokit's trainable shard is the fp32 master itself (See [Note: the shard is the fp32
    master] in zerokit/flat/sharded.py), as FSDP2's sharded parameter is."""
    return 2 * params / n_d if stage == 3 else 0


# ZeRO paper Table 1: per-device model-state memory in GB (K = 12, 16-bit gradients) by DP degree N_d,
# for stages Pos (1), Pos+g (2) and Pos+g+p (3), as printed: 3-4 significant digits, truncated in places
# (e.g. 1T, Pos, N_d = 64 is 4187.5 and printed 4187), hence a tolerance of one unit in the last digit.
ZERO_TABLE_1 = {  # (Psi, stage): the row for N_d = 1, 4, 16, 64, 256, 1024
    (7.5e9, 1): (120, 52.5, 35.6, 31.4, 30.4, 30.1),
    (7.5e9, 2): (120, 41.3, 21.6, 16.6, 15.4, 15.1),
    (7.5e9, 3): (120, 30, 7.5, 1.88, 0.47, 0.12),
    (128e9, 1): (2048, 896, 608, 536, 518, 513),
    (128e9, 2): (2048, 704, 368, 284, 263, 257),
    (128e9, 3): (2048, 512, 128, 32, 8, 2),
    (1e12, 1): (16000, 7000, 4750, 4187, 4046, 4011),
    (1e12, 2): (16000, 5500, 2875, 2218, 2054, 2013),
    (1e12, 3): (16000, 4000, 1000, 250, 62.5, 15.6),
}
DP_DEGREES = (1, 4, 16, 64, 256, 1024)


def _last_digit(printed: float) -> float:
    """One unit in the last printed digit: 0.01 for 1.88, 0.1 for 52.5, 1 for 4187."""
    text = f"{printed:g}"
    return 10.0 ** -len(text.split(".")[1]) if "." in text else 1.0


@pytest.mark.parametrize("params, stage", list(ZERO_TABLE_1), ids=[f"{p:g}-stage{s}" for p, s in ZERO_TABLE_1])
def test_zero_paper_table_1(params, stage):
    """ZeRO paper Table 1, every cell: model states per device for 7.5B, 128B and 1T parameters on 1 to
    1024 GPUs (8 per node), with the paper's 16-bit gradients."""
    for n_d, printed in zip(DP_DEGREES, ZERO_TABLE_1[(params, stage)]):
        gpus_per_node, nodes = min(n_d, 8), max(1, n_d // 8)
        planned = states(params, stage, gpus_per_node=gpus_per_node, nodes=nodes, reduce_dtype="bf16").model_states
        planned += no_16bit_shard(params, stage, n_d)
        assert abs(planned / GB - printed) < _last_digit(printed), (n_d, planned / GB, printed)


@pytest.mark.parametrize("stage, expected_gb", [(1, 71.5), (2, 48.75), (3, 22.75)])
def test_anchor_13b_on_8_a100(stage, expected_gb):
    """anchors.md section 5, ZeRO-paper row: P = 13e9, N = 8, 2 + 2 + 12 bytes per parameter.
    Z1: 26 + 26 + 12 x 13 / 8 = 26 + 26 + 19.5 = 71.5; Z2: 26 + 2 x 13 / 8 + 19.5 = 48.75; Z3: the paper's
    16 x 13 / 8 = 26 less the 16-bit shard zerokit does not keep, 2 x 13 / 8: 14 x 13 / 8 = 22.75."""
    assert states(13e9, stage, reduce_dtype="bf16").model_states == expected_gb * GB


def test_default_fp32_reduction_keeps_4_byte_gradient_shards():
    """zerokit reduces in fp32 by default and keeps the reduced shards in fp32 (the engine's
    `gradients` category): Z2 = 26 + 4 x 13 / 8 + 19.5 = 52.0; Z3 = (4 + 12) x 13 / 8 = 26.0 (the fp32 master is the
    parameter shard)."""
    assert states(13e9, 2).model_states == 52.0 * GB
    assert states(13e9, 3).model_states == 26.0 * GB
    # stage 2 reducing once per step: full bf16 gradients while accumulating, plus the fp32 shards
    assert states(13e9, 2, reduce_every_micro_step=False).gradients == 2 * 13e9 + 4 * 13e9 / 8


def test_optimizer_bytes_per_parameter():
    k = {(o, p): optimizer_state_bytes(Training(optimizer=o, precision=p))
         for o in ("adamw", "adam", "sgd-momentum", "sgd") for p in ("bf16", "fp32")}
    # mixed precision: 4 master + 4 m + 4 v = 12; 4 master + 4 momentum = 8; 4 master = 4
    assert (k["adamw", "bf16"], k["adam", "bf16"], k["sgd-momentum", "bf16"], k["sgd", "bf16"]) == (12, 12, 8, 4)
    # fp32: the parameter is the master: m + v = 8; momentum = 4; nothing = 0
    assert (k["adamw", "fp32"], k["adam", "fp32"], k["sgd-momentum", "fp32"], k["sgd", "fp32"]) == (8, 8, 4, 0)


def test_fp32_adam_and_sgd_model_states():
    # fp32 Adam, stage 0, 1e9 parameters: 4 + 4 + 8 = 16 bytes -> 16e9
    assert states(1e9, 0, precision="fp32").model_states == 16e9
    # SGD with momentum in bf16, stage 1, N = 8: 2 + 2 + 8 / 8 = 5 bytes -> 5e9 with bf16 reduction; the
    # default fp32 reduction keeps each reduced shard in fp32 until the step: + 4 / 8 at the backward peak
    assert states(1e9, 1, optimizer="sgd-momentum", reduce_dtype="bf16").model_states == 5e9
    assert states(1e9, 1, optimizer="sgd-momentum").model_states == 5.5e9


def test_frozen_parameters_cost_only_their_copy():
    # a quarter trains: params 2 x 1e9, grads 2 x 0.25e9, optimizer 12 x 0.25e9 / 8 (stage 1)
    memory = states(1e9, 1, trainable_fraction=0.25, reduce_dtype="bf16")
    assert (memory.parameters, memory.gradients, memory.optimizer_state) == (2e9, 0.5e9, 12 * 0.25e9 / 8)
    # stage 3 shards frozen parameters too: 2 x 0.75e9 / 8 (the trainable shards are the fp32 masters)
    assert states(1e9, 3, trainable_fraction=0.25).parameters == 2 * 0.75e9 / 8


def test_lora_model_states():
    """Llama-2-7B, LoRA r=16 on all seven projections: 39,976,960 adapter parameters (see models test)."""
    memory = states("llama2-7b", 0, lora_rank=16, seq_len=512)
    adapters = 39_976_960
    assert memory.parameters == 2 * (6_738_415_616 + adapters)
    assert memory.gradients == 2 * adapters + 4 * adapters  # bf16 gradients and their fp32 reduced copy
    assert memory.optimizer_state == 12 * adapters


def test_optimizer_offload_moves_state_and_sharded_gradients():
    scenario = make_scenario(13e9)
    z2 = estimate(scenario, 2, Offload(optimizer="cpu")).memory
    assert (z2.parameters, z2.gradients, z2.optimizer_state) == (26e9, 0, 0)  # only 2P stays on the GPU
    z1 = estimate(scenario, 1, Offload(optimizer="cpu")).memory
    assert z1.gradients == 26e9  # stage 1 accumulates full gradients on the GPU
    z3 = estimate(scenario, 3, Offload(optimizer="cpu", params="cpu")).memory
    assert z3.model_states == 0


def test_korthikanti_block_formula_exactly():
    """GPT block with dropout, eager attention, 16-bit: s b h (34 + 5 a s / h) bytes (Korthikanti 2022, eq. 1).
    h = 1024, a = 16, s = 2048, b = 2: s b h = 4,194,304; 34 + 5 x 16 x 2048 / 1024 = 194 -> 813,694,976."""
    arch = Architecture(n_layers=1, hidden=1024, n_heads=16, n_kv_heads=16, ffn=4096, vocab=1000, gated_mlp=False,
                        layernorm=True, dropout=True)
    training = Training(seq_len=2048, micro_batch=2, attention="eager")
    assert block_activation_bytes(arch, training) == 2048 * 2 * 1024 * (34 + 5 * 16 * 2048 // 1024) == 813_694_976


def test_llama2_13b_activations_by_hand():
    """Flash attention, SwiGLU, no dropout, bf16, s = 4096, b = 1. Per token and block:
    norms 2x2h + QKV input 2h + Q,K,V 2(h + 2h) + projection input 2h + MLP input 2h = 2 x 8h = 81,920
    plus SwiGLU 4 x 2 x f = 8 x 13,824 = 110,592 -> 192,512 bytes; fp32 log-sum-exp 4 a = 160 bytes.
    Block: 4096 x 192,672 = 789,184,512. Output: 4096 x (2 x 2 x 5120 + 4 x 32,000) = 608,174,080.
    40 blocks + output = 31,567,380,480 + 608,174,080 = 32,175,554,560."""
    model, training = preset("llama2-13b"), Training(seq_len=4096)
    assert block_activation_bytes(model.architecture, training) == 4096 * 192_672 == 789_184_512
    assert activation_bytes(model, training, Layout()) == 32_175_554_560


def test_full_checkpointing_stores_block_inputs_plus_one_block():
    """Korthikanti Table 2: full recomputation stores 2 s b h L; we add one recomputed block.
    13B: 40 x 2 x 4096 x 5120 = 1,677,721,600 + 789,184,512 + 608,174,080 = 3,075,080,192."""
    model, training = preset("llama2-13b"), Training(seq_len=4096, checkpointing="full")
    assert activation_bytes(model, training, Layout()) == 40 * 2 * 4096 * 5120 + 789_184_512 + 608_174_080


def test_tensor_and_pipeline_parallel_activations():
    """tp = 4 divides everything (sequence parallel). pp = 4 with 8 micro-batches: the first stage keeps
    min(4, 8) = 4 micro-batches of 40 / 4 = 10 blocks = the whole model's block activations."""
    model, training = preset("llama2-13b"), Training(seq_len=4096, grad_accum=8)
    block, output = 789_184_512, 608_174_080
    assert activation_bytes(model, training, Layout(tp=4)) == 40 * math.ceil(block / 4) + output // 4
    assert activation_bytes(model, training, Layout(pp=4)) == 4 * 10 * block


def test_lora_adds_its_rank_r_intermediates():
    """LoRA r = 16 on 7 projections keeps 2 x 16 x 7 = 224 more bytes per token and block."""
    model = preset("llama2-7b")
    plain = block_activation_bytes(model.architecture, Training(seq_len=512))
    lora = block_activation_bytes(model.architecture, Training(seq_len=512, trainable=Trainable(lora_rank=16)))
    assert lora - plain == 512 * 2 * 16 * 7


def test_param_count_only_has_no_activations():
    assert states(13e9, 3, seq_len=4096).activations == 0


def test_buffers_by_hand():
    rank13 = make_scenario("llama2-13b", seq_len=4096).rank
    # stage 3 (zerokit/stages/stage3.py): the root (327,685,120: embedding, head, final norm; and each
    # block's two 5,120-element norms, which join it for being under the persistence threshold: 328,094,720)
    # and two blocks of 317,194,240 gathered in bf16, the root's and three blocks' gradients staged in fp32:
    # (328,094,720 + 2 x 317,194,240) x 2 + (328,094,720 + 3 x 317,194,240) x 4 = 7,043,676,160
    assert (rank13.root, rank13.unit) == (328_094_720, 317_194_240)
    assert buffer_bytes(rank13, Training(), 3) == 962_483_200 * 2 + 1_279_677_440 * 4 == 7_043_676_160
    # stage 2: three 25 MiB fp32 staging buckets and their reduce-scatter outputs (1/8 each)
    bucket = 25 * 2**20
    assert buffer_bytes(rank13, Training(), 2) == 3 * bucket + 3 * math.ceil(bucket / 8)
    # on gloo each bucket is all-reduced in place: no reduce-scatter outputs
    assert buffer_bytes(rank13, Training(backend="gloo"), 2) == 3 * bucket
    # stage 0 all-reduces in place, or into the fp32 copy the gradients category keeps: nothing extra
    assert buffer_bytes(rank13, Training(reduce_dtype="bf16"), 0) == buffer_bytes(rank13, Training(), 0) == 0


def test_host_usage_by_hand():
    """Optimizer offload, stage 2, 8 GPUs on a DGX A100: (K 12 + fp32 grad 4 + 16-bit copy 2) bytes per
    shard element, 8 shards per node -> 18 x 13e9 = 234 GB of the 2 TiB host."""
    scenario = make_scenario(13e9)
    host = host_usage(scenario.rank, scenario.training, Offload(optimizer="cpu"), 8, 2048 * 2**30, 30 * 10**12,
                      0.1, Assumptions())
    assert host.ram == 18 * 13e9 and host.nvme == 0 and host.fits
    # NVMe: the 12 K bytes go to disk, 6 bytes stay in RAM plus one staged sub-group of 1e9 x 12
    nvme = host_usage(scenario.rank, scenario.training, Offload(optimizer="nvme"), 8, 2048 * 2**30, 30 * 10**12,
                      0.1, Assumptions())
    assert nvme.nvme == 12 * 13e9 and nvme.ram == 8 * (6 * 13e9 / 8 + 12 * 1e9)


def test_trainable_spec_validation():
    with pytest.raises(ValueError, match="fraction"):
        Trainable(fraction=1.5)
    with pytest.raises(ValueError, match="not both"):
        Trainable(fraction=0.5, lora_rank=8)


def test_from_architecture_matches_preset_counts():
    arch = preset("gpt2").architecture
    assert from_architecture(arch).total_params == 124_439_808
