"""zerokit.config.dsconfig: DeepSpeed's keys read one way, as DeepSpeed reads them; "auto" resolved and reported."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest

from zerokit.config.dsconfig import AUTO, SCHEMA, KeyClass, Kind, pending, read, resolve
from zerokit.config.dsconfig import blocks
from zerokit.config.dsconfig.schema_optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS


def test_importable_without_torch():
    code = ("import sys, zerokit.config.dsconfig, zerokit.config.dsconfig.table, zerokit.planner, zerokit.planner.translate; "
            "zerokit.config.dsconfig.read({'zero_optimization': {'stage': 3}}); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("raw, path, value", [
    ({"bf16": {"enabled": "false"}}, "bf16.enabled", False),
    ({"bf16": {"enabled": " True "}}, "bf16.enabled", True),
    ({"train_batch_size": "32"}, "train_batch_size", 32),
    ({"train_batch_size": 3.2e1}, "train_batch_size", 32),
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, "zero_optimization.reduce_bucket_size", 500_000_000),
    ({"gradient_clipping": "0.5"}, "gradient_clipping", 0.5),
    ({"gradient_clipping": 1}, "gradient_clipping", 1.0),
    ({"communication_data_type": "BFloat16"}, "communication_data_type", "bf16"),
    ({"zero_optimization": {"stage": "3", "offload_param": {"device": "CPU"}}},
     "zero_optimization.offload_param.device", "cpu"),
    ({"zero_optimization": {"stage": 3, "stage3_unit_classes": "Block"}}, "zero_optimization.stage3_unit_classes",
     ("Block",)),
    ({"optimizer": {"type": "adamw", "params": {"betas": ["0.8", 0.99]}}}, "optimizer.params.betas", (0.8, 0.99)),
    ({"gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps", AUTO),
])
def test_values_are_read_as_deepspeed_reads_them(raw, path, value):
    assert read(raw).values[path] == value


@pytest.mark.parametrize("raw, message", [
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled='yes' is not a boolean; use true or false"),
    ({"fp16": {"enabled": 0}}, "fp16.enabled=0 is not a boolean"),
    ({"train_batch_size": 2.5}, "train_batch_size=2.5 must be a whole number"),
    ({"train_batch_size": "2.5"}, "train_batch_size='2.5' must be a whole number"),
    ({"train_batch_size": True}, "train_batch_size=True is not a number"),
    ({"gradient_clipping": "Infinity"}, "gradient_clipping='Infinity' must be a finite number"),
    ({"communication_data_type": "fp8"}, "communication_data_type='fp8' is not a dtype zerokit knows"),
    ({"communication_data_type": "bfp16"}, "communication_data_type='bfp16' is not a dtype: DeepSpeed 0.19.8 refuses "
     "it too; write bf16"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}, "device='disk' is not accepted; use "
     "none, cpu or nvme"),
    ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage='auto' is not accepted"),
    ({"optimizer": {"type": "auto"}}, "optimizer.type='auto' is not one zerokit builds"),
    ({"optimizer": {"params": {"lr": 1}}}, "optimizer.params is given but optimizer.type is not"),
    ({"scheduler": {"type": "WarmupDecayLR"}}, "scheduler.params.total_num_steps is required by WarmupDecayLR"),
    ({"scheduler": {"type": "StepLR"}}, "attach a torch LR scheduler to engine.optimizer instead"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, "warmup_type='cubic' is not accepted; "
     "use log or linear"),
    ({"flops_profiler": []}, "flops_profiler must be a JSON object, not []"),
    ([1, 2], "a DeepSpeed config must be a JSON object, not list"),
])
def test_bad_values_are_one_line_naming_the_key(raw, message):
    with pytest.raises(ValueError) as error:
        read(raw)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization": {"stage3_param_persistance_threshold": 1}},
     "unknown zero_optimization key 'stage3_param_persistance_threshold'; did you mean "
     "stage3_param_persistence_threshold?"),
    ({"wall_clock_breakdwon": True},
     "unknown top-level key 'wall_clock_breakdwon'; did you mean wall_clock_breakdown?"),
    ({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}},
     "unknown zero_optimization.offload_optimizer key 'pin_memroy'; did you mean pin_memory?"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
     "unknown optimizer.params key 'weight_decy'; did you mean weight_decay?"),
    ({"optimizer": {"type": "Adamw8bit"}}, "optimizer.type='Adamw8bit' is not one zerokit builds; did you mean AdamW?"),
    ({"tensorboard": {"enabled": False, "xyz": 1}}, "unknown tensorboard key 'xyz'; accepted: enabled, job_name, "
     "output_path"),
])
def test_a_misspelt_key_is_refused_with_the_closest_accepted_one(raw, message):
    with pytest.raises(ValueError, match="^" + message.replace("?", r"\?").replace("(", r"\(").replace(")", r"\)")):
        read(raw)


def test_comments_and_nulls():
    config = read({"_comment": "top", "zero_optimization": {"_note": {"anything": 1}, "stage": 1,
                                                             "reduce_scatter": None},
                   "flops_profiler": {"output_file": None}})
    assert dict(config.values) == {"zero_optimization.stage": 1, "flops_profiler.output_file": None}


def test_aliases_and_legacy_keys_are_read_as_their_key_and_noted():
    config = read({"bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "max_live_parameters": 1e8, "stage3_gather_fp16_weights_on_model_save": "true",
        "cpu_offload": True, "cpu_offload_param": False, "cpu_offload_use_pin_memory": False}})
    values = config.values
    assert values["bf16.enabled"] is True and values["zero_optimization.stage3_max_live_parameters"] == 10**8
    assert values["zero_optimization.stage3_gather_16bit_weights_on_model_save"] is True
    assert values["zero_optimization.offload_optimizer.device"] == "cpu"
    assert values["zero_optimization.offload_optimizer.pin_memory"] is False
    assert "zero_optimization.offload_param.device" not in values
    assert "zero_optimization.cpu_offload=true: read as offload_optimizer.device=cpu" in config.notes
    assert config.spelling("bf16.enabled") == "bfloat16.enabled"


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization": {"stage": 3, "max_live_parameters": 1, "stage3_max_live_parameters": 2}},
     "zero_optimization.stage3_max_live_parameters and zero_optimization.max_live_parameters are two spellings"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "two spellings of one key"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.cpu_offload and zero_optimization.offload_optimizer both set offload_optimizer"),
])
def test_two_spellings_of_one_key_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        read(raw)


def test_refused_keys_pass_while_they_ask_for_nothing():
    config = read({"autotuning": {"enabled": False, "fast": True}, "comet": {"enabled": "false"},
                   "tensor_parallel": {"autotp_size": 1}, "pipeline": {}, "sequence_parallel_size": 1,
                   "zero_optimization": {"stage": 3, "zero_quantized_weights": False, "zero_hpz_partition_size": 1,
                                         "zenflow": None}})
    assert config.values["zero_optimization.zero_quantized_weights"] is False


def test_refusals_can_be_collected_instead():
    config = read({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
                  refuse=False)
    assert [r.path for r in config.refusals] == ["pipeline", "zero_optimization.zero_quantized_gradients"]
    assert all("\n" not in r.message and "asks for" in r.message for r in config.refusals)
    with pytest.raises(ValueError, match="removed in DeepSpeed 0.19.8"):  # removed keys raise either way
        read({"curriculum_learning": {"enabled": True}}, refuse=False)


def test_stage3_keys_at_another_stage_are_dropped_and_noted():
    """DeepSpeed reads stage-3 keys only at stage 3 and trains without them below it; so does zerokit."""
    config = read({"zero_optimization": {"stage": 2, "max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": "auto"}})
    assert not config.given("zero_optimization.stage3_max_reuse_distance")
    assert not config.given("zero_optimization.stage3_prefetch_bucket_size")
    assert config.notes == ("zero_optimization.max_reuse_distance: read as zero_optimization.stage3_max_reuse_distance",
                            "zero_optimization.max_reuse_distance=1000000000: not used at stage 2 (DeepSpeed reads it "
                            "only at stage 3)",
                            "zero_optimization.stage3_prefetch_bucket_size='auto': not used at stage 2 (DeepSpeed "
                            "reads it only at stage 3)")


# --- "auto" and the batch identity ------------------------------------------------------------------

def choices(raw, **context):
    return {choice.path: choice.value for choice in resolve(read(raw), **context).choices}


@pytest.mark.parametrize("given, world, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
    ({"train_batch_size": 12}, 3, (12, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 5}, 2, (10, 5, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}, 5,
     (5, 1, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}, 4,
     (8, 2, 1)),
    ({"gradient_accumulation_steps": 3}, 2, (6, 1, 3)),
])
def test_batch_sizes_are_derived_as_deepspeed_derives_them(given, world, expected):
    resolved = resolve(read(given), world_size=world).config
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    assert tuple(resolved.get(key) for key in keys) == expected


@pytest.mark.parametrize("given, world, message", [
    ({"train_batch_size": 33}, 2, "train_batch_size=33 cannot be split over 1 accumulation steps x 2 ranks"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3}, 2, "cannot be split over 3 micro-batch x 2 "
     "ranks"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3,
     "train_batch_size=32 but train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size = 4 x 2 x 3"),
    ({"train_batch_size": 0}, 1, "train_batch_size=0 must be >= 1"),
])
def test_a_batch_that_cannot_be_split_is_one_line(given, world, message):
    with pytest.raises(ValueError, match=message):
        resolve(read(given), world_size=world)


def test_hidden_size_rules_are_hugging_faces():
    raw = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    assert pending(read(raw)) == tuple(f"zero_optimization.{name}" for name in (
        "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"))
    got = choices(raw, world_size=1, hidden_size=1000)
    assert got == {"zero_optimization.reduce_bucket_size": 1_000_000,
                   "zero_optimization.stage3_prefetch_bucket_size": 900_000,
                   "zero_optimization.stage3_param_persistence_threshold": 10_000}
    # A model that says no hidden size (no host framework to fill these in): zerokit's own defaults, named.
    assert choices(raw, world_size=1) == {"zero_optimization.reduce_bucket_size": 25 * 2**20 // 4,
                                          "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
                                          "zero_optimization.stage3_param_persistence_threshold": 100_000}
    bf16_reduction = choices({**raw, "communication_data_type": "bf16"}, world_size=1)
    assert bf16_reduction["zero_optimization.reduce_bucket_size"] == 25 * 2**20 // 2  # 25 MiB of the reduce dtype
    lines = [choice.line() for choice in resolve(read(raw), world_size=1).choices]
    assert lines[0] == ('zero_optimization.reduce_bucket_size: "auto" -> 6553600 (zerokit\'s default bucket, 25 MiB '
                        'of fp32: the model has no config.hidden_size)')


def test_context_free_auto_values():
    got = choices({"gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2,
                   "overlap_comm": "auto", "sub_group_size": "auto"},
                   "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "adam_w_mode": "auto"}},
                   "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": "auto"}}})
    assert got == {"gradient_clipping": 1.0, "bf16.enabled": False, "zero_optimization.overlap_comm": True,
                   "zero_optimization.sub_group_size": None, "optimizer.params.lr": 1e-3,
                   "optimizer.params.betas": (0.9, 0.999), "optimizer.params.adam_w_mode": True,
                   "scheduler.params.cycle_max_lr": None}
    with pytest.raises(ValueError, match="total_num_steps='auto': zerokit cannot know how many steps"):
        resolve(read({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}))


# --- the schema itself --------------------------------------------------------------------------

def test_every_key_says_what_zerokit_does():
    for path, key in SCHEMA.items():
        assert key.note, path
        if key.klass in (KeyClass.REFUSED, KeyClass.REMOVED):
            assert key.why, path
        if key.klass == KeyClass.ALWAYS and key.accepts:
            assert key.why, path
        if key.klass == KeyClass.ALIAS:
            assert key.alias_of in SCHEMA, path
        if key.kind == Kind.CHOICE:
            assert key.default in key.choices, path


def test_block_defaults_are_deepspeeds():
    """Each typed block's field defaults equal the schema's (DeepSpeed's) defaults for its keys."""
    sections = {blocks.ActivationCheckpointing: "activation_checkpointing", blocks.CommsLogger: "comms_logger",
                blocks.FlopsProfiler: "flops_profiler", blocks.Monitor: "csv_monitor", blocks.Wandb: "wandb",
                blocks.Preemption: "preemption"}
    for cls, section in sections.items():
        for field in dataclasses.fields(cls):
            assert field.default == SCHEMA[f"{section}.{field.name}"].default, (cls, field.name)
    for field in dataclasses.fields(blocks.Offload):
        for section in ("offload_optimizer", "offload_param"):
            key = SCHEMA.get(f"zero_optimization.{section}.{field.name}")
            if key is not None and field.name != "buffer_count":
                assert field.default == key.default, (section, field.name)


def test_optimizer_and_scheduler_tables():
    assert set(OPTIMIZER_PARAMS) == {"Adam", "AdamW", "SGD", "Adagrad", "Muon"}
    assert set(SCHEDULER_PARAMS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
    spec = blocks.OptimizerSpec(type="adam", params={"adam_w_mode": "false"})
    assert spec.type == "Adam" and spec.adam_w_mode is False and spec.value("lr") == 1e-3
    assert blocks.OptimizerSpec(type="AdamW").adam_w_mode and blocks.OptimizerSpec(type="Muon").adam_w_mode
    with pytest.raises(ValueError, match="adam_w_mode=false is not supported: AdamW always decouples"):
        blocks.OptimizerSpec(type="AdamW", params={"adam_w_mode": False})
    with pytest.raises(ValueError, match="optimizer.params.momentun is not a SGD parameter; did you mean momentum"):
        blocks.OptimizerSpec(type="SGD", params={"momentun": 0.9})


@pytest.mark.parametrize("offload, message", [
    ({"device": "nvme"}, "offload.device=nvme needs offload.nvme_path"),
    ({"device": "cpu", "ratio": 0}, "offload.ratio=0 must be in (0, 1]"),
    ({"device": "cpu", "buffer_count": -1}, "offload.buffer_count=-1 must be >= 0"),
])
def test_offload_rules(offload, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        blocks.Offload(**offload)


def test_wandb_needs_its_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="wandb.enabled=true needs the wandb package, which is not installed"):
        blocks.Wandb(enabled=True)
    assert not blocks.Wandb(enabled=False).enabled
