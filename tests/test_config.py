"""Config: DeepSpeed-style dicts and JSON files become one typed ZeroConfig; bad input is one line."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from zerokit.config.typed import DEFAULT_BUCKET_BYTES, LossScaling, MixedPrecision, ZeroConfig, load_config, replace


def test_deepspeed_dict_is_read() -> None:
    config = load_config({
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "overlap_comm": True},
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
    })
    assert config.stage == 2 and config.gradient_accumulation_steps == 4 and config.gradient_clipping == 1.0
    assert config.precision == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert config.reduce_bucket_bytes == 4_000_000  # DeepSpeed counts elements; fp32 reduction: 4 bytes each
    assert config.loss_scaling is None


def test_fp16_block_becomes_loss_scaling(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                         "loss_scale_window": 50, "hysteresis": 1, "min_loss_scale": 2},
                                "communication_data_type": "bf16"}))
    config = load_config(str(path))
    assert config.loss_scaling == LossScaling(initial_scale_power=12, window=50, hysteresis=1, min_scale=2.0)
    assert config.precision.reduce_dtype == torch.bfloat16
    assert load_config({"fp16": {"enabled": True, "loss_scale": 128}}).loss_scaling.static_scale == 128


def test_defaults_and_typed_config_pass_through() -> None:
    typed = ZeroConfig(stage=1)
    assert load_config(typed) is typed
    assert load_config(None) == ZeroConfig()
    assert ZeroConfig().reduce_bucket_bytes == DEFAULT_BUCKET_BYTES


@pytest.mark.parametrize("raw,message", [
    ({"zero_optimization": {"stage": 4}}, "stage=4 is not a ZeRO stage"),
    ({"zero_optimization": {"stage": True}}, "stage=True is not a ZeRO stage"),
    ({"zero_optimization": {"stage3_max_live_parametres": 1}},
     "unknown zero_optimization key 'stage3_max_live_parametres'; did you mean stage3_max_live_parameters?"),
    ({"step_per_print": 10}, "unknown top-level key 'step_per_print'; did you mean steps_per_print?"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb' asks for DeepSpeed's FusedLamb CUDA kernel"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "enable at most one"),
    ({"zero_optimization": {"reduce_bucket_size": 10, "reduce_bucket_bytes": 10}}, "not both"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "must be > 0"),
    ({"zero_optimization": {"stage": 1, "reduce_every_micro_step": False}}, "is a stage-2 choice"),
    ({"gradient_clipping": -1}, "must be >= 0"),
    ({"gradient_accumulation_steps": 0}, "must be >= 1"),
    ({"communication_data_type": "fp8"}, "use fp32, bf16 or fp16"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "must be 0 (dynamic) or a positive number"),
    # Booleans: JSON true/false or the strings "true"/"false" (never bool("false") == True); not 1, 0 or "no".
    ({"fp16": {"enabled": 1}}, "fp16.enabled=1 is not a boolean; use true or false"),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": 0}}, "reduce_scatter=0 is not a boolean"),
    ({"zero_optimization": {"stage": 2, "reduce_every_micro_step": "no"}},
     "zero_optimization.reduce_every_micro_step='no' is not a boolean"),
    # Whole numbers: ints, floats that are whole (5e8) and strings of them; never bools or fractions.
    ({"gradient_accumulation_steps": 2.7}, "gradient_accumulation_steps=2.7 must be a whole number"),
    ({"gradient_accumulation_steps": "2.5"}, "gradient_accumulation_steps='2.5' must be a whole number"),
    ({"gradient_accumulation_steps": "four"}, "gradient_accumulation_steps='four' is not a number"),
    ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps=True is not a number"),
    ({"zero_optimization": {"reduce_bucket_size": 0.5}}, "zero_optimization.reduce_bucket_size=0.5 must be a whole"),
    ({"zero_optimization": {"reduce_bucket_bytes": 1e6 + 0.5}}, "zero_optimization.reduce_bucket_bytes=1000000.5"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": float("inf")}},
     "zero_optimization.stage3_max_live_parameters=inf must be a whole number"),
    ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage='auto' is not accepted"),
    ({"fp16": {"enabled": True, "hysteresis": 1.5}}, "fp16.hysteresis=1.5 must be a whole number"),
    ({"max_consecutive_skipped_steps": False}, "max_consecutive_skipped_steps=False is not a number"),
    ({"train_batch_size": [32]}, "train_batch_size=[32] is not a number"),
    # Finite numbers: a nan clip value compares false with everything and would disable clipping.
    ({"gradient_clipping": float("nan")}, "gradient_clipping=nan must be a finite number"),
    ({"gradient_clipping": float("inf")}, "gradient_clipping=inf must be a finite number"),
    ({"gradient_clipping": "nan"}, "gradient_clipping='nan' must be a finite number"),
    ({"fp16": {"enabled": True, "loss_scale": float("nan")}}, "fp16.loss_scale=nan must be a finite number"),
    ({"fp16": {"enabled": True, "min_loss_scale": float("-inf")}}, "fp16.min_loss_scale=-inf must be a finite"),
    # Sections are objects.
    ({"bf16": True}, "bf16 must be a JSON object, not True"),
    ({"zero_optimization": 2}, "zero_optimization must be a JSON object, not 2"),
    ({"communication_data_type": ["bf16"]}, "communication_data_type=['bf16'] is not a dtype"),
    ({"zero_optimization": {"stage": 1, "sub_group_size": -1}}, "sub_group_size=-1 must be an element count >= 0"),
    # Contradictions: keys that the chosen precision would silently ignore.
    ({"fp16": {"loss_scale": 0}}, "fp16.loss_scale is set but fp16.enabled is not; set fp16.enabled to true or false"),
])
def test_bad_config_is_one_clear_line(raw, message) -> None:
    with pytest.raises(ValueError) as error:
        load_config(raw)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_config_sources(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="must be a ZeroConfig, a dict or a JSON file path"):
        load_config(42)


def test_batch_size_identity_is_checked() -> None:
    config = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": 2})
    config.check_batch_sizes(world_size=4)
    with pytest.raises(ValueError, match=r"= 4 x 2 x 3 = 24"):
        config.check_batch_sizes(world_size=3)


def test_deepspeed_number_spellings_still_read() -> None:
    """JSON has one number type: 5e8 arrives as a float and is accepted wherever it is a whole count."""
    config = load_config({
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "sub_group_size": 1e9,
                              "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e7,
                              "stage3_param_persistence_threshold": 1e5, "stage3_unit_classes": ["Block"],
                              "reduce_scatter": True, "contiguous_gradients": True, "overlap_comm": True},
        "gradient_accumulation_steps": 2.0, "gradient_clipping": 1, "train_batch_size": 16.0,
        "train_micro_batch_size_per_gpu": 8,
    })
    assert config.reduce_bucket_bytes == 4 * 500_000_000 and config.sub_group_size == 10**9
    assert config.stage3.max_live_parameters == 10**9 and config.stage3.prefetch_numel == 5 * 10**7
    assert config.stage3.persistence_threshold == 10**5 and config.stage3.unit_classes == ("Block",)
    assert type(config.gradient_accumulation_steps) is int and config.gradient_accumulation_steps == 2
    assert type(config.gradient_clipping) is float and config.train_batch_size == 16
    assert config.reduce_scatter is True


def test_flags_keep_their_meaning() -> None:
    """Real false values still switch things off, and absent or null flags keep their defaults."""
    config = load_config({"zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_scatter": False,
                                                "reduce_every_micro_step": False},
                          "bf16": {"enabled": False}, "fp16": {"enabled": False}})
    assert not config.overlap_comm and config.reduce_scatter is False and not config.reduce_every_micro_step
    assert config.precision.param_dtype == torch.float32
    assert load_config({"zero_optimization": {"stage": 2}}).reduce_scatter is None
    assert load_config({"zero_optimization": {"stage": 2, "reduce_scatter": None}}).reduce_scatter is None
    assert load_config({"zero_optimization": {"stage": 0, "reduce_scatter": True}}).reduce_scatter  # as DeepSpeed


def test_nan_from_a_json_file_is_rejected(tmp_path) -> None:
    """json.loads reads the non-standard NaN literal, so the file path needs the check as much as dicts do."""
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": NaN}')
    with pytest.raises(ValueError, match="gradient_clipping=nan must be a finite number"):
        load_config(str(path))


def test_planner_emitted_configs_are_accepted() -> None:
    """`zerokit plan --emit zerokit` writes DeepSpeed-style sizes as element counts; every stage must load."""
    from zerokit.planner import estimate, make_scenario
    from zerokit.planner.emit import emit_zerokit

    for stage in (0, 1, 2, 3):
        emitted = emit_zerokit(estimate(make_scenario("llama2-7b", seq_len=2048), stage))
        assert load_config(emitted).stage == stage


def test_a_disabled_fp16_block_with_scaling_keys_loads_as_deepspeed_templates_do() -> None:
    config = load_config({"bf16": {"enabled": True}, "fp16": {"enabled": False, "loss_scale": 0,
                                                            "initial_scale_power": 12}})
    assert config.precision.param_dtype == torch.bfloat16 and config.loss_scaling is None


def test_deepspeed_spellings_are_read_as_deepspeed_reads_them() -> None:
    """Changed deliberately (issue 12): quoted booleans and numbers, "auto" and DeepSpeed's everyday keys were
    refused before; they are read now, and never silently wrong: "false" is false."""
    config = load_config({
        "bf16": {"enabled": "false"}, "fp16": {"enabled": "auto", "loss_scale": 0},
        "zero_optimization": {"stage": "2", "overlap_comm": "false", "contiguous_gradients": "true",
                              "reduce_bucket_size": "5e8", "sub_group_size": "auto", "allgather_bucket_size": 5e8},
        "train_batch_size": "32", "gradient_accumulation_steps": "auto", "gradient_clipping": "1.0",
        "steps_per_print": 10, "optimizer": {"type": "AdamW", "params": {"lr": "3e-4"}},
    })
    assert config.precision.param_dtype == torch.float32 and config.loss_scaling is None
    assert config.stage == 2 and config.overlap_comm is False and config.reduce_bucket_bytes == 4 * 500_000_000
    assert config.sub_group_size is None and config.allgather_bucket_size == 500_000_000
    assert config.gradient_accumulation_steps == 1 and config.gradient_clipping == 1.0
    assert config.train_batch_size == 32 and config.steps_per_print == 10
    assert config.optimizer.type == "AdamW" and config.optimizer.value("lr") == 3e-4
    assert any("contiguous_gradients=true: accepted" in line for line in config.startup_log_lines())


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.device=nvme needs zero_optimization.offload_optimizer.nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"ratio": 0.5}}},
     "unknown zero_optimization.offload_param key 'ratio'"),
    ({"zero_optimization": {"allgather_bucket_size": 0}}, "allgather_bucket_size=0 must be > 0"),
    ({"steps_per_print": 0}, "steps_per_print=0 must be >= 1"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor=0.0 must be > 0"),
    ({"comm_timeout_seconds": -1}, "comm_timeout_seconds=-1.0 must be a positive number of seconds"),
    ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype='int8' is not a dtype"),
    ({"activation_checkpointing": {"number_checkpoints": 0}}, "number_checkpoints=0 must be >= 1"),
    ({"flops_profiler": {"enabled": True, "profile_step": 0}}, "flops_profiler.profile_step=0 must be >= 1"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "set the top-level gradient_clipping"),
    ({"preemption": {"enabled": True}}, "preemption.enabled needs preemption.save_dir"),
    ({"preemption": {"signals": ["SIGKILL"]}}, "preemption.signals: 'SIGKILL' is not a signal a process can catch"),
    ({"preemption": {"exit_code": 0}}, "preemption.exit_code=0 must be 1-125: 0 reads as a finished job"),
    ({"preemption": {"exit_code": 143}}, "preemption.exit_code=143 must be 1-125"),
    ({"preemption": {"save_to": "ckpt"}}, "unknown preemption key 'save_to'"),
])
def test_new_fields_are_validated_in_one_line(raw, message):
    with pytest.raises(ValueError) as error:
        load_config(raw)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_optimizer_at_stage_0_is_dropped_from_a_dict_and_refused_when_typed(device: str) -> None:
    """A DeepSpeed dict at stage 0 with an offload_optimizer block trains as DeepSpeed trains it, which ignores the
    block (issue 31: Megatron-DeepSpeed's ds_config-gpt.json); a typed ZeroConfig asks for the offload by name,
    and is refused."""
    from zerokit.config.typed import Offload

    block = {"device": device, "nvme_path": "/nvme"}
    config = load_config({"zero_optimization": {"stage": 0, "offload_optimizer": block}}).resolve(world_size=2)
    assert config.offload_optimizer.device == "none" and config.stage == 0
    assert f"zero_optimization.offload_optimizer.device={device}: not used at stage 0" in \
        "\n".join(config.startup_log_lines())
    with pytest.raises(ValueError, match=f"offload_optimizer.device={device} needs stage 1, 2 or 3"):
        ZeroConfig(stage=0, offload_optimizer=Offload(**block))


def test_typed_fields_for_what_the_reader_honours():
    from zerokit.config.typed import ActivationCheckpointing, Offload, OptimizerSpec, SchedulerSpec

    config = load_config({
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme",
                                                            "buffer_count": 6, "max_in_cpu": 1e8},
                              "offload_optimizer": {"device": "cpu", "ratio": 0.3, "pipeline_read": True}},
        "zero_allow_untested_optimizer": True, "comm_timeout_seconds": 60, "broadcast_buffers": False,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR"},
        "activation_checkpointing": {"cpu_checkpointing": True}, "prescale_gradients": True,
        "data_types": {"grad_accum_dtype": "bf16"}, "dataloader_drop_last": True,
    })
    assert config.offload_param == Offload(device="nvme", nvme_path="/local_nvme", buffer_count=6,
                                           max_in_cpu=100_000_000)
    assert config.offload_optimizer == Offload(device="cpu", ratio=0.3, pipeline_read=True)
    assert config.allow_untested_optimizer and config.comm_timeout_seconds == 60.0 and not config.broadcast_buffers
    assert config.optimizer == OptimizerSpec(type="SGD", params={"lr": 0.1})
    assert config.scheduler == SchedulerSpec(type="WarmupLR")
    assert config.activation_checkpointing == ActivationCheckpointing(cpu_checkpointing=True)
    assert config.prescale_gradients and config.grad_accum_dtype == torch.bfloat16 and config.dataloader_drop_last
    defaults = ZeroConfig()
    assert defaults.comm_timeout_seconds == 300.0 and defaults.broadcast_buffers
    assert defaults.offload_param.buffer_count == 5 and defaults.offload_optimizer.buffer_count == 4
    assert not defaults.offload_optimizer.enabled and defaults.allgather_bucket_size == 500_000_000
    assert not ZeroConfig(allgather_partitions=False).allgather_partitions  # a speed-only choice: never refused


def test_the_preemption_block_is_read_off_by_default_and_named_at_start():
    from zerokit.config.typed import Preemption

    assert not ZeroConfig().preemption.enabled
    config = load_config({"preemption": {"enabled": True, "save_dir": "ckpt", "signals": ["usr1", "SIGTERM"]}})
    assert config.preemption == Preemption(enabled=True, save_dir="ckpt", signals=("SIGUSR1", "SIGTERM"), exit_code=75)
    assert "preemption: SIGUSR1, SIGTERM finish the step in flight, save a checkpoint in ckpt and exit with code 75" \
        in config.startup_log_lines()


def test_resolve_fills_in_auto_and_logs_it():
    config = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                          "gradient_accumulation_steps": "auto", "bf16": {"enabled": True},
                          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                "stage3_param_persistence_threshold": "auto"}})
    assert config.pending_auto == ("zero_optimization.reduce_bucket_size",
                                   "zero_optimization.stage3_param_persistence_threshold")
    resolved = config.resolve(world_size=4, hidden_size=32)
    assert resolved.reduce_bucket_bytes == 32 * 32 * 4 and resolved.stage3.persistence_threshold == 320
    assert (resolved.train_batch_size, resolved.gradient_accumulation_steps) == (8, 1)
    lines = resolved.startup_log_lines()
    assert "train_batch_size: \"auto\" -> 8 (micro-batch x accumulation x 4 ranks)" in lines
    assert any(line.startswith("communication_data_type not set") for line in lines)
    assert resolved.resolve(world_size=4, hidden_size=32).stage3 == resolved.stage3  # idempotent
    typed = ZeroConfig(train_batch_size=8, train_micro_batch_size_per_gpu=2)
    assert typed.resolve(world_size=4) is typed and typed.startup_log_lines() == []
    with pytest.raises(ValueError, match="train_batch_size=8 but"):
        typed.resolve(world_size=3)


def test_hidden_size_of_reads_model_configs():
    from types import SimpleNamespace

    from zerokit.config.typed import hidden_size_of

    def model(**config):
        module = torch.nn.Linear(1, 1)
        module.config = SimpleNamespace(**config)
        return module

    assert hidden_size_of(model(hidden_size=4096)) == 4096
    assert hidden_size_of(model(hidden_sizes=[64, 128, 320])) == 320
    assert hidden_size_of(model(text_config=SimpleNamespace(hidden_size=2048))) == 2048
    assert hidden_size_of(model(n_embd=768)) == 768
    assert hidden_size_of(torch.nn.Linear(3, 3)) is None


def test_tensorboard_needs_its_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="tensorboard.enabled=true needs the tensorboard package"):
        load_config({"tensorboard": {"enabled": True}})
    assert not load_config({"tensorboard": {"enabled": False, "output_path": "tb"}}).tensorboard.enabled


def test_resolve_keeps_fields_replaced_after_reading():
    """resolve() fills in what the dict left to the world size and the model from the config's own fields (the dict
    is not read again); a field changed with replace() since reading stays, and what is derived from it agrees (before
    one projection, an accumulation the dict did not name went back to 1 and the batch size was derived from that)."""
    config = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                          "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}})
    edited = replace(config, gradient_accumulation_steps=4, stage3=replace(config.stage3, min_unit_params=7))
    resolved = edited.resolve(world_size=2, hidden_size=10)
    assert (resolved.gradient_accumulation_steps, resolved.train_batch_size) == (4, 16)
    assert (resolved.stage3.min_unit_params, resolved.stage3.prefetch_numel) == (7, 90)
    assert resolved.resolve(world_size=2, hidden_size=10) == resolved  # idempotent


def test_typed_defaults_are_the_schemas():
    """Every field a DeepSpeed key holds as it is defaults to that key's schema default (an absent key and a typed
    config mean the same), except the accumulation steps, which the schema leaves to be derived."""
    from zerokit.config.typed import FIELDS
    from zerokit.config.dsconfig.schema import default

    typed, read = ZeroConfig(), load_config({})
    for path, name in FIELDS.items():
        value = typed.stage3 if name.startswith("stage3.") else typed
        value = getattr(value, name.removeprefix("stage3."))
        assert value == (1 if path == "gradient_accumulation_steps" else default(path)), path
    assert read == typed
