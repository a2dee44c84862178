"""The same configs through DeepSpeed's own config class and schedules (when deepspeed is installed, the bench
extra): resolved batch sizes, precision, stage and LR schedule values must equal zerokit's."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from zerokit.config.typed import load_config
from zerokit.config.dsconfig import read
from zerokit.config.dsconfig.blocks import SchedulerSpec
from zerokit.engine.schedules import build_scheduler

deepspeed = pytest.importorskip("deepspeed")
from deepspeed.runtime import lr_schedules  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "ds_configs"
WORLD, HIDDEN = 2, 64


class DataParallelOnly:
    """What DeepSpeedConfig asks an mpu for: the data-parallel world size."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


@pytest.fixture
def deepspeed_config(monkeypatch):
    # DeepSpeedConfig asks deepspeed.comm for the rank first and falls back to world size 1 without a process
    # group; rank 0 of a WORLD-rank job is what we compare.
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *args, **kwargs: 0)
    return lambda raw: DeepSpeedConfig(raw, mpu=DataParallelOnly(WORLD))


def as_deepspeed_reads_it(raw: dict, config) -> dict:
    """The fixture as DeepSpeed is given it: "auto" filled in with zerokit's choices (as Hugging Face's Trainer
    fills it in), and the spellings DeepSpeed 0.19.8 does not parse itself ("5e7" as a string, numbers as strings
    at the top level, which it reads without coercion) written as the values zerokit read."""
    out = copy.deepcopy(raw)
    written = {spelled: path for path, spelled in read(raw).spelled.items()}
    for spelled, path in written.items():
        *blocks, name = spelled.split(".")
        node = out
        for block in blocks:
            node = node[block]
        value = node.get(name)
        if isinstance(value, str) and value != "auto" and config.source.get(path) != value:
            node[name] = config.source.get(path)
    for choice in config.auto_choices:
        if choice.derived:
            continue
        *blocks, name = choice.path.split(".")
        node = out
        for block in blocks:
            node = node[block]
        if choice.value is None:
            del node[name]
        else:
            node[name] = list(choice.value) if isinstance(choice.value, tuple) else choice.value
    return out


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda path: path.name)
def test_deepspeed_resolves_the_config_as_zerokit_does(path, deepspeed_config):
    raw = json.loads(path.read_text())
    ours = load_config(str(path)).resolve(world_size=WORLD, hidden_size=HIDDEN)
    if not any(key in raw for key in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        raw["train_micro_batch_size_per_gpu"] = 1  # DeepSpeed needs one batch key; zerokit assumes this one
    theirs = deepspeed_config(as_deepspeed_reads_it(raw, ours))
    assert (theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu, theirs.gradient_accumulation_steps) == \
        (ours.train_batch_size, ours.train_micro_batch_size_per_gpu, ours.gradient_accumulation_steps)
    assert theirs.zero_optimization_stage == ours.stage
    assert (theirs.bfloat16_config.enabled, theirs.float16_config.enabled) == \
        (ours.precision.param_dtype == torch.bfloat16, ours.precision.param_dtype == torch.float16)
    zero = theirs.zero_config
    assert (zero.offload_optimizer.device if zero.offload_optimizer else "none") == ours.offload_optimizer.device
    assert (zero.offload_param.device if zero.offload_param else "none") == ours.offload_param.device
    if ours.stage == 3:
        assert (zero.max_live_parameters, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
            ours.stage3.max_live_parameters, ours.stage3.prefetch_numel, ours.stage3.persistence_threshold)
    if ours.loss_scaling is not None:
        fp16 = theirs.float16_config
        assert (fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis) == (
            ours.loss_scaling.initial_scale_power, ours.loss_scaling.window, ours.loss_scaling.hysteresis)
    if ours.scheduler is not None:
        assert theirs.scheduler_name == ours.scheduler.type
        assert_same_schedule(ours.scheduler, theirs.scheduler_params, steps=40)


def assert_same_schedule(spec: SchedulerSpec, deepspeed_params: dict, steps: int) -> None:
    """Step DeepSpeed's schedule and zerokit's side by side over twin AdamW optimizers: lr and betas agree."""
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    theirs_opt, ours_opt = torch.optim.AdamW([weights[0]], lr=0.3), torch.optim.AdamW([weights[1]], lr=0.3)
    theirs = getattr(lr_schedules, spec.type)(theirs_opt, **deepspeed_params)
    ours = build_scheduler(spec, ours_opt)[0]
    for step in range(steps + 1):
        theirs_group, ours_group = theirs_opt.param_groups[0], ours_opt.param_groups[0]
        assert ours_group["lr"] == pytest.approx(theirs_group["lr"], rel=1e-12, abs=1e-15), (spec.type, step)
        assert ours_group["betas"] == pytest.approx(theirs_group["betas"]), (spec.type, step)
        theirs_opt.step()
        ours_opt.step()
        theirs.step()
        ours.step()


@pytest.mark.parametrize("kind, params", [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_min_lr": 0.0, "warmup_max_lr": 0.2, "warmup_num_steps": 6}),
    ("WarmupDecayLR", {"total_num_steps": 4, "warmup_num_steps": 6, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5, "cos_min_ratio": 0.2, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5, "cycle_second_step_size": 3,
                  "decay_step_size": 2, "decay_lr_rate": 0.3, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 6, "cycle_first_stair_count": 3,
                  "cycle_second_stair_count": 2}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 3.0}),
    ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
])
def test_schedules_equal_deepspeeds(kind, params):
    assert_same_schedule(SchedulerSpec(type=kind, params=params), params, steps=40)


def test_every_key_deepspeeds_models_accept_is_in_the_schema():
    """DeepSpeed's pydantic sections forbid unknown keys, so their fields (and aliases) are the keys it knows
    there; the schema must classify each of them (a new DeepSpeed release adding one fails here)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    from zerokit.config.dsconfig import SCHEMA

    sections = {"zero_optimization": DeepSpeedZeroConfig, "zero_optimization.offload_param":
                DeepSpeedZeroOffloadParamConfig, "zero_optimization.offload_optimizer":
                DeepSpeedZeroOffloadOptimizerConfig, "bf16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config,
                "tensorboard": TensorBoardConfig, "wandb": WandbConfig, "csv_monitor": CSVConfig,
                "comms_logger": CommsLoggerConfig}
    missing = [f"{section}.{name}" for section, model in sections.items()
               for field_name, field in model.model_fields.items() for name in {field_name, field.alias} - {None}
               if f"{section}.{name}" not in SCHEMA]
    assert missing == []
    assert "comet" in SCHEMA and set(CometConfig.model_fields) >= {"enabled"}  # refused as a block while enabled
