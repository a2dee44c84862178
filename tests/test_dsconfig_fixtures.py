"""DeepSpeed configs as users have them (tests/fixtures/ds_configs/): each becomes a typed ZeroConfig, and each
out-of-scope feature (refused/) is refused in one line naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerokit.config.typed import load_config
from zerokit.engine.schedules import build_optimizer, build_scheduler

FIXTURES = Path(__file__).parent / "fixtures" / "ds_configs"
ACCEPTED = sorted(FIXTURES.glob("*.json"))
REFUSED = sorted((FIXTURES / "refused").glob("*.json"))
WORLD, HIDDEN = 2, 64

# fixture -> what the typed config must hold once resolved for 2 ranks and a hidden size of 64
EXPECTED = {
    "seed.json": dict(stage=3, allgather_bucket_size=500_000_000, overlap_comm=True,
                      offload=("cpu", True, "cpu", True)),
    "hf_zero2_auto.json": dict(stage=2, dtype=torch.float32, batch=(2, 1, 1), gradient_clipping=1.0,
                               reduce_bucket_bytes=4 * 200_000_000, offload=("cpu", True, "none", True),
                               optimizer=("AdamW", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                    "weight_decay": 0.0}),
                               scheduler=("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": None,
                                                       "warmup_num_steps": 1000}), steps_per_print=2000),
    "hf_zero3_auto.json": dict(stage=3, dtype=torch.bfloat16, batch=(16, 2, 4), reduce_bucket_bytes=4 * 64 * 64,
                               prefetch=int(0.9 * 64 * 64), persistence=640, offload=("cpu", True, "cpu", True),
                               optimizer=("AdamW", {"lr": 2e-5, "weight_decay": 0.1, "eps": 1e-8})),
    "legacy_zero2.json": dict(stage=2, dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, batch=(32, 4, 4),
                              offload=("cpu", False, "none", True), allow_untested_optimizer=True,
                              optimizer=("Adam", {"adam_w_mode": False, "weight_decay": 0.01})),
    "legacy_zero3.json": dict(stage=3, dtype=torch.float16, batch=(8, 2, 2), offload=("cpu", True, "cpu", True),
                              max_live=30_000_000, prefetch=10_000_000, persistence=100_000),
    "strings.json": dict(stage=1, dtype=torch.bfloat16, batch=(16, 4, 2), gradient_clipping=1.0, overlap_comm=False,
                         reduce_scatter=True, reduce_bucket_bytes=4 * 50_000_000),
    "observability.json": dict(stage=1, steps_per_print=50, wall_clock_breakdown=True, gradient_predivide_factor=2.0,
                               grad_accum_dtype=torch.float32),
    "bert_fp16_onecycle.json": dict(stage=1, dtype=torch.float16, batch=(64, 16, 2), gradient_clipping=1.0,
                                    optimizer=("SGD", {"momentum": 0.9, "nesterov": True}),
                                    scheduler=("OneCycle", {"cycle_max_lr": 0.01, "decay_lr_rate": 0.1})),
    "adam_warmup_decay.json": dict(stage=2, batch=(8, 4, 1), optimizer=("Adam", {"betas": (0.9, 0.95)}),
                                   scheduler=("WarmupDecayLR", {"warmup_type": "linear", "total_num_steps": 20})),
    "adagrad_lr_range.json": dict(stage=0, batch=(8, 4, 1), optimizer=("Adagrad", {"lr": 0.01}),
                                  scheduler=("LRRangeTest", {"lr_range_test_staircase": True})),
    "muon_warmup.json": dict(stage=1, dtype=torch.bfloat16, batch=(2, 1, 1),
                             optimizer=("Muon", {"adam_lr": 3e-4, "weight_decay": 0.01})),
}


def test_every_fixture_has_expectations():
    assert {path.name for path in ACCEPTED} == set(EXPECTED)


def check_fields(config, expected: dict) -> None:
    simple = {"stage", "gradient_clipping", "reduce_bucket_bytes", "allgather_bucket_size", "overlap_comm",
              "reduce_scatter", "steps_per_print", "wall_clock_breakdown", "gradient_predivide_factor",
              "grad_accum_dtype", "allow_untested_optimizer"}
    for name in simple & expected.keys():
        assert getattr(config, name) == expected[name], name
    if "dtype" in expected:
        assert config.precision.param_dtype == expected["dtype"]
    assert config.precision.reduce_dtype == expected.get("reduce_dtype", torch.float32)
    if "batch" in expected:
        assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
                config.gradient_accumulation_steps) == expected["batch"]
    for name, field in (("max_live", "max_live_parameters"), ("prefetch", "prefetch_numel"),
                        ("persistence", "persistence_threshold")):
        if name in expected:
            assert getattr(config.stage3, field) == expected[name], name
    if "offload" in expected:
        o, p = config.offload_optimizer, config.offload_param
        assert (o.device, o.pin_memory, p.device, p.pin_memory) == expected["offload"]
    for block in ("optimizer", "scheduler"):
        if block in expected:
            spec, (type_name, values) = getattr(config, block), expected[block]
            assert spec.type == type_name and {name: spec.value(name) for name in values} == values


@pytest.mark.parametrize("path", ACCEPTED, ids=lambda path: path.name)
def test_fixture_becomes_a_typed_config(path):
    config = load_config(str(path)).resolve(world_size=WORLD, hidden_size=HIDDEN)
    check_fields(config, EXPECTED[path.name])
    assert not config.pending_auto and all("\n" not in line for line in config.startup_log_lines())


def test_auto_and_always_keys_are_in_the_startup_log():
    lines = load_config(str(FIXTURES / "hf_zero3_auto.json")).resolve(WORLD, HIDDEN).startup_log_lines()
    assert "zero_optimization.reduce_bucket_size: \"auto\" -> 4096 (hidden^2, hidden size 64, as Hugging Face sets " \
           "it)" in lines
    assert "train_batch_size: \"auto\" -> 16 (micro-batch x accumulation x 2 ranks)" in lines
    assert any(line.startswith("zero_optimization.stage3_max_reuse_distance=1000000000: accepted") for line in lines)
    seed = load_config(str(FIXTURES / "seed.json")).startup_log_lines()
    assert any(line.startswith("zero_optimization.allgather_partitions=true: accepted") for line in seed)


def test_pending_auto_waits_for_resolve():
    config = load_config(str(FIXTURES / "hf_zero3_auto.json"))
    assert config.pending_auto == ("zero_optimization.reduce_bucket_size",
                                   "zero_optimization.stage3_prefetch_bucket_size",
                                   "zero_optimization.stage3_param_persistence_threshold")
    with pytest.raises(ValueError, match="call config.resolve"):
        config.check_batch_sizes(WORLD)
    assert any(line.startswith("still to resolve") for line in config.startup_log_lines())


@pytest.mark.parametrize("path", REFUSED, ids=lambda path: path.name)
def test_out_of_scope_feature_is_refused_naming_its_key(path):
    key = json.loads(path.read_text())["_refused"]
    with pytest.raises(ValueError) as error:
        load_config(str(path))
    message = str(error.value)
    assert message.startswith(key) and "\n" not in message
    assert "asks for" in message or "removed in DeepSpeed 0.19.8" in message


@pytest.mark.parametrize("path", [p for p in ACCEPTED if "optimizer" in json.loads(p.read_text())],
                         ids=lambda path: path.name)
def test_fixture_optimizer_and_schedule_train(path):
    """The blocks build torch objects that train a tiny model (one process; the engine wires them in)."""
    torch.manual_seed(0)
    config = load_config(str(path)).resolve(WORLD, HIDDEN)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 16))
    optimizers = build_optimizer(config.optimizer, model)
    schedules = build_scheduler(config.scheduler, optimizers) if config.scheduler else []
    tokens = torch.randint(0, 16, (4, 6))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for schedule in schedules:
            schedule.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
