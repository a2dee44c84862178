"""DeepSpeed <-> FSDP <-> zerokit: round trips, explanations, errors for what has no equivalent."""

from __future__ import annotations

import pytest

from zerokit.planner import estimate, make_scenario
from zerokit.planner.emit import emit, emit_zerokit
from zerokit.planner.spec import Offload
from zerokit.planner.translate import (
    APPROXIMATE,
    DROPPED,
    EXACT,
    NONE,
    ZEROKIT_KEYS,
    FsdpTerms,
    deepspeed_to_fsdp,
    deepspeed_to_zerokit,
    fsdp_to_deepspeed,
    parse_fsdp_terms,
    zerokit_to_deepspeed,
)


def ds(stage, precision="bf16", **zero):
    return {precision: {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, **zero}}


def semantic(config):
    """What a round trip must keep: stage, offload devices, compute dtype, clipping."""
    zero = config["zero_optimization"]
    return (zero["stage"], (zero.get("offload_optimizer") or {}).get("device", "none"),
            (zero.get("offload_param") or {}).get("device", "none"),
            "bf16" if "bf16" in config else "fp16" if "fp16" in config else "fp32", config.get("gradient_clipping"))


@pytest.mark.parametrize("config", [
    ds(0), ds(1), ds(2), ds(3), ds(3, "fp16"),
    ds(3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}),
])
def test_deepspeed_fsdp_round_trip(config):
    there = deepspeed_to_fsdp(config)
    back = fsdp_to_deepspeed(FsdpTerms(**there.config))
    assert semantic(back.config) == semantic(config)


@pytest.mark.parametrize("stage, strategy", [(0, "NO_SHARD"), (2, "SHARD_GRAD_OP"), (3, "FULL_SHARD")])
def test_fsdp_names_for_each_stage(stage, strategy):
    result = deepspeed_to_fsdp(ds(stage))
    assert result.config["sharding"] == strategy and result.mappings[0].kind == EXACT


def test_stage1_is_zero_redundancy_optimizer_approximately():
    result = deepspeed_to_fsdp(ds(1))
    assert result.config["zero_redundancy_optimizer"] and result.mappings[0].kind == APPROXIMATE
    assert "3 Psi" in result.mappings[0].why


@pytest.mark.parametrize("config", [
    ds(2), ds(3, reduce_bucket_size=5e8, overlap_comm=True),
    {"fp16": {"enabled": True, "loss_scale": 0}, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}},
])
def test_deepspeed_zerokit_round_trip(config):
    there = deepspeed_to_zerokit(config)
    back = zerokit_to_deepspeed(there.config)
    assert back.config == there.config  # zerokit's keys are DeepSpeed's
    assert semantic(back.config) == semantic(config)


def test_tuning_knobs_are_dropped_with_a_reason():
    result = deepspeed_to_fsdp(ds(3, stage3_max_reuse_distance=1e9, sub_group_size=1e9, stage3_prefetch_bucket_size=5e7))
    kinds = {m.source.split("=")[0]: m.kind for m in result.mappings}
    assert kinds["max_reuse_distance"] == DROPPED and kinds["sub_group_size"] == DROPPED
    assert kinds["prefetch_bucket_size"] == APPROXIMATE
    assert all(m.why for m in result.mappings)


@pytest.mark.parametrize("config, message", [
    (ds(2, offload_optimizer={"device": "cpu"}), "no fsdp equivalent for offload_optimizer.device=cpu"),
    (ds(3, offload_param={"device": "nvme"}, offload_optimizer={"device": "nvme"}), "FSDP has no NVMe offload"),
    (ds(3, zero_quantized_weights=True), "zero_quantized_weights=True"),
])
def test_no_fsdp_equivalent_is_a_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        deepspeed_to_fsdp(config)
    partial = deepspeed_to_fsdp(config, allow_partial=True)
    assert partial.unmapped and all(m.kind == NONE for m in partial.unmapped)


def test_hybrid_shard_has_no_deepspeed_or_zerokit_equivalent():
    with pytest.raises(ValueError, match="DeepSpeed has no HSDP"):
        fsdp_to_deepspeed(parse_fsdp_terms(["HYBRID_SHARD", "param_dtype=bf16"]))
    with pytest.raises(ValueError, match="zerokit shards over one flat group"):
        deepspeed_to_zerokit(ds(3, zero_hpz_partition_size=8))


def test_reshard_after_forward_int_is_hpz():
    back = fsdp_to_deepspeed(parse_fsdp_terms(["reshard_after_forward=8"]))
    assert back.config["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 8}
    there = deepspeed_to_fsdp(back.config)
    assert there.config["reshard_after_forward"] == 8


def test_parse_fsdp_terms():
    terms = parse_fsdp_terms(["SHARD_GRAD_OP", "CPUOffload", "param_dtype=torch.bfloat16", "reduce_dtype=float32",
                              "clip_grad_norm=1.0", "gradient_accumulation_steps=4"])
    assert terms == FsdpTerms(sharding="SHARD_GRAD_OP", cpu_offload=True, param_dtype="bf16", reduce_dtype="fp32",
                              clip_grad_norm=1.0, gradient_accumulation_steps=4)
    assert parse_fsdp_terms(["reshard_after_forward=False"]).sharding == "SHARD_GRAD_OP"


@pytest.mark.parametrize("terms, message", [
    (["QUARTER_SHARD"], "FSDP term 'QUARTER_SHARD' is not understood"),
    (["reshard_after_forward=maybe"], "must be true, false or a positive integer"),
    (["param_dtype=int8"], "param_dtype='int8' is not accepted"),
    (["mesh=2x8"], "FSDP key 'mesh' is not understood"),
])
def test_bad_fsdp_terms(terms, message):
    with pytest.raises(ValueError, match=message):
        parse_fsdp_terms(terms)


@pytest.mark.parametrize("zero, message", [
    ({"stage": 5}, "stage=5 is not a ZeRO stage"),
    ({"stage": 3, "mics_shard_size": 8}, "removed in DeepSpeed 0.19.8"),
    ({"stage": 3, "turbo": True}, "unknown zero_optimization key 'turbo'"),
    ({"stage": 3, "offload_param": {"device": "disk"}}, "device='disk' is not accepted"),
])
def test_bad_deepspeed_configs(zero, message):
    with pytest.raises(ValueError, match=message):
        deepspeed_to_fsdp({"zero_optimization": zero})


def test_zerokit_keys_are_what_the_engine_reads():
    """Everything the translator and emitter write for zerokit must be a key zerokit/config.py accepts
    (offload keys are the agreed interface the engine is adding; see the report)."""
    config = pytest.importorskip("zerokit.config")
    planned = set(ZEROKIT_KEYS) - {"offload_optimizer", "offload_param"}
    assert planned <= config.ZERO_KEYS
    emitted = emit_zerokit(estimate(make_scenario("llama2-13b", seq_len=4096), 3))
    assert set(emitted) <= config.TOP_LEVEL_KEYS
    loaded = config.load_config(emitted)
    assert loaded.stage == 3 and loaded.reduce_bucket_bytes == 25 * 2**20
    # Llama-2-70B: root 2 x 32,000 x 8,192 + 8,192 = 524,296,192 and blocks of 855,654,400 parameters;
    # the engine's default 1e9 live elements could not hold root + two blocks, so the config raises it.
    big = config.load_config(emit_zerokit(estimate(make_scenario("llama2-70b", seq_len=4096), 3)))
    assert big.stage3.max_live_parameters == 524_296_192 + 2 * 855_654_400
    assert big.stage3.prefetch_numel == 855_654_400


def test_emitted_fsdp_code_compiles_and_names_real_apis():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    assert all(hasattr(fsdp, name) for name in ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy"))
    for stage in (0, 1, 2, 3):
        code = emit(estimate(make_scenario("llama2-13b", seq_len=4096, checkpointing="full"), stage), "fsdp").config
        compile(code, f"stage{stage}.py", "exec")
    offloaded = estimate(make_scenario("llama2-13b"), 3, Offload(optimizer="cpu", params="cpu"))
    assert "CPUOffloadPolicy(pin_memory=True)" in emit(offloaded, "fsdp").config


def test_emit_refuses_what_the_target_cannot_express():
    scenario = make_scenario("llama2-13b", seq_len=4096)
    with pytest.raises(ValueError, match="cannot offload only the optimizer"):
        emit(estimate(scenario, 2, Offload(optimizer="cpu")), "fsdp")
    hsdp = make_scenario("llama2-13b", nodes=2, replicas=2)
    with pytest.raises(ValueError, match="DeepSpeed has no HSDP"):
        emit(estimate(hsdp, 3), "deepspeed")
    assert 'mesh_dim_names=("replicate", "shard")' in emit(estimate(hsdp, 3), "fsdp").config
    with pytest.raises(ValueError, match="on paper only"):
        emit(estimate(make_scenario("llama2-13b", nodes=2, tp=8), 1), "zerokit")
    with pytest.raises(ValueError, match="emit target 'megatron' is not accepted"):
        emit(estimate(scenario, 3), "megatron")


def test_emitted_deepspeed_config_translates_back_to_the_pick():
    result = estimate(make_scenario("llama2-70b", seq_len=4096, checkpointing="full"), 3, Offload(optimizer="cpu"))
    emitted = emit(result, "deepspeed")
    assert emitted.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert any("checkpointing" in note for note in emitted.notes)
    with pytest.raises(ValueError, match="does not offload yet"):  # until zerokit has offload tiers
        deepspeed_to_zerokit(emitted.config)
    with pytest.raises(ValueError, match="does not offload yet"):
        emit(result, "zerokit")
