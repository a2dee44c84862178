"""Config: DeepSpeed-style dicts and JSON files become one typed ZeroConfig; bad input is one line."""

from __future__ import annotations

import json

import pytest
import torch

from zerokit.config import DEFAULT_BUCKET_BYTES, LossScaling, MixedPrecision, ZeroConfig, load_config


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
    ({"zero_optimization": {"stage": 1, "stage3_max_reuse_distance": 1}},
     "unknown config key zero_optimization.'stage3_max_reuse_distance'"),
    ({"zero_optimization": {"stage": 1, "sub_group_size": 0}}, "sub_group_size=0 must be a positive element count"),
    ({"steps_per_print": 10}, "unknown config key 'steps_per_print'; accepted:"),
    ({"optimizer": {"type": "AdamW"}}, "wraps the torch optimizer you pass"),
    ({"zero_optimization": {"allgather_bucket_size": 5e8}}, "set reduce_bucket_size"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "enable at most one"),
    ({"zero_optimization": {"reduce_bucket_size": 10, "reduce_bucket_bytes": 10}}, "not both"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "must be > 0"),
    ({"zero_optimization": {"stage": 1, "reduce_every_micro_step": False}}, "is a stage-2 choice"),
    ({"gradient_clipping": -1}, "must be >= 0"),
    ({"gradient_accumulation_steps": 0}, "must be >= 1"),
    ({"communication_data_type": "fp8"}, "use fp32, bf16 or fp16"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "must be 0 (dynamic) or a positive number"),
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
