"""What the engine does with a DeepSpeed config beyond the stage: the optimizer and LR schedule of its blocks
(stepped only on steps not skipped), get_lr(), both-given errors, schedules in state_dict(); prescale_gradients
and gradient_predivide_factor (2 ranks: bit-identical to plain averaging for powers of two, and keeping an
fp16 reduction from overflowing); data_types.grad_accum_dtype; and every fixture config loading and training."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zerokit
from zerokit.engine.schedules import warmup_decay_lr
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups
from zerokit.testing.spawn import spawn

FIXTURES = Path(__file__).parent / "fixtures" / "ds_configs"
TOKENS = torch.randint(0, 67, (4, 17), generator=torch.Generator().manual_seed(3))


def tiny(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(TinyGPTConfig())


def train(engine: zerokit.Engine, micro_steps: int, tokens: torch.Tensor = TOKENS) -> list:
    results = []
    for _ in range(micro_steps):
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        results.append((engine.step(), engine.get_lr()))
    return results


SCHEDULE = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3,
                                                "total_num_steps": 8, "warmup_type": "linear"}}


# --- optimizer and scheduler blocks -----------------------------------------------------------------------

def test_the_schedule_steps_at_optimizer_steps_that_were_not_skipped(one_process) -> None:
    """fp16 with a loss scale that overflows at first: DeepSpeed does not step its schedule on a skipped step,
    so the learning rate after n applied steps is the formula's at iteration n - 1, whatever was skipped."""
    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2, "scheduler": SCHEDULE,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "fp16": {"enabled": True, "initial_scale_power": 22, "hysteresis": 1}}
    engine = zerokit.initialize(tiny(), config=config)
    applied, skipped = 0, 0
    for result, lrs in train(engine, 20):
        if result.boundary:
            applied, skipped = applied + result.stepped, skipped + result.skipped
        expected = warmup_decay_lr(applied - 1, 0.001, 0.01, 3, "linear", 8)
        assert lrs == pytest.approx([expected] * len(lrs))
    assert skipped >= 3 and applied >= 5  # skips before and after applied steps; the schedule reached its decay


def test_the_optimizer_block_is_built_over_model_parameters(one_process) -> None:
    model = tiny()
    groups = param_groups(model, weight_decay=0.1)
    engine = zerokit.initialize(model, config={"zero_optimization": {"stage": 1}, "scheduler": SCHEDULE,
                                               "optimizer": {"type": "Adam", "params": {"lr": 0.01}}},
                                model_parameters=groups)
    assert type(engine.optimizer) is torch.optim.AdamW  # Adam with DeepSpeed's default adam_w_mode
    assert [group["weight_decay"] for group in engine.optimizer.param_groups] == [0.1, 0.0]
    assert engine.get_lr() == [0.001, 0.001] and engine.lr_scheduler is engine.lr_schedules[0]


def test_muon_gets_a_schedule_per_optimizer(one_process) -> None:
    engine = zerokit.initialize(tiny(), config={"zero_optimization": {"stage": 1}, "scheduler": SCHEDULE,
                                                "optimizer": {"type": "Muon", "params": {"lr": 0.01}}})
    assert [type(o).__name__ for o in engine.optimizer] == ["Muon", "AdamW"]
    assert isinstance(engine.lr_scheduler, list) and len(engine.lr_scheduler) == 2
    train(engine, 2)
    assert engine.get_lr() == pytest.approx([0.004] * len(engine.get_lr())) and len(engine.get_lr()) >= 2


def test_optimizer_mistakes_are_one_line(one_process) -> None:
    model = tiny()
    with pytest.raises(ValueError) as both:
        zerokit.initialize(model, torch.optim.AdamW(model.parameters()), {"optimizer": {"type": "AdamW"}})
    assert str(both.value).startswith("initialize() got an optimizer and the config has an 'optimizer' block")
    neither = zerokit.initialize(model, config={"zero_optimization": {"stage": 1}})  # forward only (issue 36)
    assert neither.optimizer is None and neither.safeguards.forward_only is not None


def test_state_dict_carries_the_schedule(one_process) -> None:
    config = {"zero_optimization": {"stage": 2}, "scheduler": SCHEDULE, "optimizer": {"type": "AdamW"}}
    engine = zerokit.initialize(tiny(), config=config)
    train(engine, 3)
    state = copy.deepcopy(engine.state_dict())
    ahead = [lrs for _, lrs in train(engine, 4)]
    resumed = zerokit.initialize(tiny(1), config=config)
    resumed.load_state_dict(state)
    assert [lrs for _, lrs in train(resumed, 4)] == ahead


# --- prescale_gradients, gradient_predivide_factor (2 ranks) --------------------------------------------------

PREDIVISION = {"default": {}, "prescale": {"prescale_gradients": True}, "predivide-2": {"gradient_predivide_factor": 2.0},
               "predivide-3": {"gradient_predivide_factor": 3.0}}


def run_predivision(rank: int, world_size: int) -> dict:
    out = {}
    tokens = torch.randint(0, 67, (4, 17), generator=torch.Generator().manual_seed(10 + rank))
    for stage in (0, 1, 2, 3):
        for name, keys in PREDIVISION.items():
            zero = {"stage": stage, "reduce_bucket_size": 4000, **({"stage3_min_unit_params": 1000} if stage == 3 else {})}
            config = {"zero_optimization": zero,
                      # SGD: a parameter moves by lr x its gradient, so rounding in the gradient stays rounding
                      # (Adam would blow a near-zero gradient's rounding up to a step of lr)
                      "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                      "gradient_accumulation_steps": 2, **keys}
            engine = zerokit.initialize(tiny(), config=config)
            train(engine, 4, tokens)
            out[stage, name] = {key: value for key, value in engine.full_state_dict().items()}
        out[stage, "fp16-reduction"] = [_huge_gradient(stage, keys) for keys in ({}, {"prescale_gradients": True})]
    return out


def _huge_gradient(stage: int, keys: dict) -> tuple[bool, float]:
    """A 40000 gradient on each rank: fp16 holds it, but not the sum of two (80000 > 65504)."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.ones_(model.weight)
    engine = zerokit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                {"zero_optimization": {"stage": stage}, "communication_data_type": "fp16", **keys})
    engine.backward(engine(torch.full((1, 1), 40000.0)).sum())
    result = engine.step()
    return result.skipped, result.grad_norm


@pytest.fixture(scope="module")
def predivision() -> list[dict]:
    return spawn(run_predivision, 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_predivision_by_powers_of_two_is_bit_identical(predivision, stage: int) -> None:
    """See [Note: gradient pre-division] in zerokit/stages/averaging.py."""
    for rank in range(2):
        default = predivision[rank][stage, "default"]
        for name in ("prescale", "predivide-2"):
            assert all(torch.equal(default[key], value) for key, value in predivision[rank][stage, name].items()), name
        for key, value in predivision[rank][stage, "predivide-3"].items():
            torch.testing.assert_close(value, default[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_prescaling_keeps_an_fp16_reduction_from_overflowing(predivision, stage: int) -> None:
    (plain_skipped, _), (prescaled_skipped, norm) = predivision[0][stage, "fp16-reduction"]
    assert plain_skipped and not prescaled_skipped and norm == 40000.0


# --- data_types.grad_accum_dtype ---------------------------------------------------------------------------------

@pytest.mark.parametrize("keys,line", [
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_accumulation_steps": 2},
     "data_types.grad_accum_dtype=fp32: gradients accumulate across micro-steps in fp32 at stage 2"),
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
     "data_types.grad_accum_dtype=fp32: accepted; with gradient_accumulation_steps=1 nothing accumulates"),
])
def test_grad_accum_dtype_is_honoured_where_the_stage_accumulates_in_it(one_process, capsys, keys, line) -> None:
    zerokit.initialize(tiny(), config={**keys, "data_types": {"grad_accum_dtype": "fp32"},
                                       "optimizer": {"type": "AdamW"}})
    assert line in capsys.readouterr().err


@pytest.mark.parametrize("keys,start", [
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
     "data_types.grad_accum_dtype=fp32 with bf16 compute at zero_optimization.stage=1 is not offered: this stage "
     "accumulates full gradients in the compute dtype (bf16)"),
    ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "communication_data_type": "bf16"},
     "data_types.grad_accum_dtype=fp32 with bf16 compute at zero_optimization.stage=3 is not offered: this stage "
     "accumulates reduced shards in communication_data_type (bf16)"),
])
def test_grad_accum_dtype_elsewhere_is_refused_in_one_line(one_process, keys, start) -> None:
    with pytest.raises(ValueError) as error:
        zerokit.initialize(tiny(), config={**keys, "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW"},
                                           "data_types": {"grad_accum_dtype": "fp32"}})
    assert str(error.value).startswith(start) and "\n" not in str(error.value)


# --- the fixture configs train (2 ranks, one spawn) --------------------------------------------------------

def run_fixtures(rank: int, world_size: int, directory: str) -> dict[str, list[float]]:
    os.chdir(directory)  # csv_monitor and flops_profiler write relative to it
    out = {}
    for path in sorted(FIXTURES.glob("*.json")):
        raw = json.loads(path.read_text())
        model = tiny()
        optimizer = None if "optimizer" in raw else torch.optim.AdamW(param_groups(model), lr=1e-3)
        engine = zerokit.initialize(model, optimizer, raw)
        micro = engine.config.train_micro_batch_size_per_gpu
        tokens = torch.randint(0, 67, (micro, 17), generator=torch.Generator().manual_seed(rank))
        losses = []
        for _ in range(3 * engine.config.gradient_accumulation_steps):
            loss = lm_loss(engine(tokens[:, :-1]), tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[path.name] = losses
    return out


def test_every_fixture_config_trains_on_two_ranks(tmp_path) -> None:
    trained = spawn(run_fixtures, 2, str(tmp_path))
    for name, losses in trained[0].items():
        assert all(torch.isfinite(torch.tensor(losses))), name
    assert (tmp_path / "logs" / "run1" / "Train_Samples_lr.csv").is_file()  # observability.json's csv_monitor
