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


def test_hybrid_shard_has_no_deepspeed_equivalent_but_zerokit_keeps_mics_and_hpz():
    with pytest.raises(ValueError, match="DeepSpeed has no HSDP"):
        fsdp_to_deepspeed(parse_fsdp_terms(["HYBRID_SHARD", "param_dtype=bf16"]))
    for key, value in (("zero_hpz_partition_size", 8), ("mics_shard_size", 8)):  # issue 26
        assert deepspeed_to_zerokit(ds(3, **{key: value})).config["zero_optimization"][key] == value


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
    ({"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}, "removed in DeepSpeed 0.19.8"),
    ({"stage": 3, "turbo": True}, "unknown zero_optimization key 'turbo'"),
    ({"stage": 3, "offload_param": {"device": "disk"}}, "device='disk' is not accepted"),
])
def test_bad_deepspeed_configs(zero, message):
    with pytest.raises(ValueError, match=message):
        deepspeed_to_fsdp({"zero_optimization": zero})


def test_zerokit_keys_are_what_the_engine_reads():
    """Everything the emitter writes for zerokit is a key the engine's reader honours (one schema for both)."""
    config = pytest.importorskip("zerokit.config.typed")
    from zerokit.config.dsconfig import SCHEMA, KeyClass, read

    emitted = emit_zerokit(estimate(make_scenario("llama2-13b", seq_len=4096), 3))
    assert {SCHEMA[path].klass for path in read(emitted).values} <= {KeyClass.HONOURED, KeyClass.ZEROKIT}
    loaded = config.load_config(emitted)
    assert loaded.stage == 3 and loaded.reduce_bucket_bytes == 25 * 2**20
    # Llama-2-70B: the engine's default 1e9 live elements could not hold the root and two blocks, so the emitted
    # config raises the limit (the planner's own tests check its arithmetic); the engine reads what it wrote.
    emitted = emit_zerokit(estimate(make_scenario("llama2-70b", seq_len=4096), 3))
    big = config.load_config(emitted)
    assert big.stage3.max_live_parameters == emitted["zero_optimization"]["stage3_max_live_parameters"] > 10**9
    assert big.stage3.prefetch_numel == emitted["zero_optimization"]["stage3_prefetch_bucket_size"]


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
    # Changed deliberately: MiCS is emitted now (mics_shard_size, with a note that DeepSpeed 0.19.8 refuses it;
    # tests/planner/test_hybrid_plan.py), so HSDP is no longer refused
    with pytest.raises(ValueError, match="no hybrid ZeRO-1"):
        emit(estimate(hsdp, 1), "fsdp")
    assert 'mesh_dim_names=("replicate", "shard")' in emit(estimate(hsdp, 3), "fsdp").config
    # Changed deliberately: zerokit trains a tensor degree (tensor_parallel.autotp_size, ZeRO 0-3), DeepSpeed's
    # AutoTP at ZeRO 0-2; FSDP's is model code
    tensor = make_scenario("llama2-13b", nodes=2, tp=8)
    assert emit(estimate(tensor, 3), "zerokit").config["tensor_parallel"] == {"autotp_size": 8}
    assert emit(estimate(tensor, 1), "deepspeed").config["tensor_parallel"] == {"autotp_size": 8}
    with pytest.raises(ValueError, match="AutoTP training takes ZeRO 0-2, not ZeRO-3 with tp=8"):
        emit(estimate(tensor, 3), "deepspeed")
    with pytest.raises(ValueError, match="set up in model code"):
        emit(estimate(tensor, 2), "fsdp")
    with pytest.raises(ValueError, match="emit target 'megatron' is not accepted"):
        emit(estimate(scenario, 3), "megatron")


def test_emitted_deepspeed_config_translates_back_to_the_pick():
    result = estimate(make_scenario("llama2-70b", seq_len=4096, checkpointing="full"), 3, Offload(optimizer="cpu"))
    emitted = emit(result, "deepspeed")
    assert emitted.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert any("checkpointing" in note for note in emitted.notes)
    # Changed deliberately: the engine's config reads the offload blocks now, so they translate exactly.
    there = deepspeed_to_zerokit(emitted.config)
    assert there.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("optimizer,params", [("cpu", "none"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "nvme")])
def test_emitted_zerokit_config_offloads_as_the_pick_does(optimizer, params):
    """The engine offloads to both tiers, so an offloaded pick is emitted with its blocks, which the engine's
    own config reader turns back into the pick's tiers."""
    config = pytest.importorskip("zerokit.config.typed")
    result = estimate(make_scenario("llama2-70b", seq_len=4096), 3, Offload(optimizer=optimizer, params=params))
    emitted = emit(result, "zerokit")
    zero = emitted.config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == optimizer
    assert ("offload_param" in zero) == (params != "none")
    read = config.load_config(emitted.config)
    assert read.offload_optimizer.device == optimizer
    assert read.offload_param.device == ("none" if params == "none" else params)
    assert any("nvme_path" in note for note in emitted.notes) == ("nvme" in (optimizer, params))


def test_translator_and_engine_read_one_format():
    """The drifts of issue 8: "false" is false in both readers, and stage3_unit_classes goes both ways."""
    assert deepspeed_to_fsdp({"bf16": {"enabled": "false"}, "zero_optimization": {"stage": 2}}).config["param_dtype"] \
        == "fp32"
    assert deepspeed_to_zerokit({"bf16": {"enabled": "true"}}).config["bf16"] == {"enabled": True}
    back = zerokit_to_deepspeed({"zero_optimization": {"stage": 3, "stage3_unit_classes": ["LlamaDecoderLayer"],
                                                       "stage3_min_unit_params": 1000}})
    assert back.config == {"zero_optimization": {"stage": 3}}
    assert {m.kind for m in back.mappings} == {EXACT, DROPPED}
    assert "leaf_module" in next(m.why for m in back.mappings if "unit_classes" in m.source)


def test_legacy_spellings_and_strings_translate_as_the_engine_reads_them():
    config = {"zero_optimization": {"stage": "3", "cpu_offload": True, "max_live_parameters": "1e9",
                                    "stage3_gather_fp16_weights_on_model_save": "true"},
              "bfloat16": {"enabled": True}, "communication_data_type": "BFloat16", "_comment": "ignored"}
    zk = deepspeed_to_zerokit(config).config
    assert zk["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                       "stage3_max_live_parameters": 1_000_000_000}
    # accepted by zerokit, but it sets nothing there: dropped with what zerokit does instead
    assert "full_state_dict" in next(m.why for m in deepspeed_to_zerokit(config).mappings if "gather" in m.source)
    assert zk["bf16"] == {"enabled": True} and zk["communication_data_type"] == "bf16"
    fsdp = deepspeed_to_fsdp({**config, "zero_optimization": {"stage": 3, "cpu_offload_param": True,
                                                              "cpu_offload": True}})
    assert fsdp.config["cpu_offload"] and fsdp.config["param_dtype"] == "bf16" and fsdp.config["reduce_dtype"] == "bf16"


def test_zerokit_refusals_are_no_equivalent():
    with pytest.raises(ValueError, match="no zerokit equivalent for pipeline"):
        deepspeed_to_zerokit({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}})
    partial = deepspeed_to_zerokit({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
                                   allow_partial=True)
    assert [m.kind for m in partial.unmapped] == [NONE] and "quantized gradient" in partial.unmapped[0].why
    with pytest.raises(ValueError, match="did you mean stage3_param_persistence_threshold"):
        deepspeed_to_zerokit({"zero_optimization": {"stage": 3, "stage3_param_persistance_threshold": 1}})


def test_reduce_bucket_bytes_become_elements_of_the_reduce_dtype():
    back = zerokit_to_deepspeed({"zero_optimization": {"stage": 2, "reduce_bucket_bytes": 4_000_000},
                                 "communication_data_type": "bf16"})
    assert back.config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 2_000_000}


def test_every_zero_key_has_an_fsdp_mapping():
    """FSDP_KNOBS is the translator's only table; it must name every zero_optimization key the schema knows."""
    from zerokit.config.dsconfig import SCHEMA, KeyClass
    from zerokit.planner.translate import FSDP_KNOBS, MAPPED_WITH_THE_STAGE, Z, short_name

    zero_keys = {short_name(path) for path, key in SCHEMA.items() if path.startswith(Z)
                 and path.count(".") == 1 and key.klass not in (KeyClass.ALIAS, KeyClass.REMOVED)}
    handled = set(FSDP_KNOBS) | set(MAPPED_WITH_THE_STAGE) | {"offload_optimizer", "offload_param"}
    assert zero_keys == handled
