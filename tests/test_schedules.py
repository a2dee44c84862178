"""zerokit.engine.schedules: DeepSpeed's LR schedules, step by step against their formulas, and the optimizers an
`optimizer` block builds."""

from __future__ import annotations

import math

import pytest
import torch

from zerokit.config.dsconfig.blocks import OptimizerSpec, SchedulerSpec
from zerokit.engine.schedules import DeepSpeedLR, both_given_error, build_optimizer, build_scheduler


def lrs(schedule_type: str, params: dict, steps: int, lr: float = 1.0, optimizer: str = "SGD") -> list[float]:
    """The learning rate at construction and after each of `steps` optimizer steps."""
    weight = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([weight], lr=lr) if optimizer == "SGD" else torch.optim.AdamW([weight], lr=lr)
    schedule = build_scheduler(SchedulerSpec(type=schedule_type, params=params), opt)[0]
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        schedule.step()
        out.append(opt.param_groups[0]["lr"])
        assert schedule.get_last_lr() == [out[-1]]
    return out


# DeepSpeed counts last_batch_iteration from -1 at construction; the lr after n steps is its formula at n - 1.
LOG3_4 = math.log(3) / math.log(4)
COS_1_6 = (1 + math.cos(math.pi / 6)) / 2


@pytest.mark.parametrize("kind, params, expected", [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4},
     [0.0, 0.0, 0.05, 0.1 * LOG3_4, 0.1, 0.1, 0.1]),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"},
     [0.0, 0.0, 0.025, 0.05, 0.075, 0.1, 0.1]),
    ("WarmupLR", {"warmup_min_lr": 0.2, "warmup_num_steps": 1, "warmup_type": "linear"},  # 1 step counts as 2
     [0.2, 0.2, 0.6, 1.0, 1.0]),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4,
                       "warmup_type": "linear"},
     [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0, 0.0]),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.0,
                        "warmup_type": "linear"},
     [0.0, 0.1, 0.325, 0.55, 0.775, COS_1_6, 0.75, 0.5, 0.25, 1 - COS_1_6, 0.0, 0.0, 0.0]),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "decay_step_size": 2,
                  "decay_lr_rate": 0.5},
     [0.1, 0.325, 0.55, 0.775, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1 / 1.25, 0.1 / 1.5, 0.1 / 1.75]),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "cycle_first_stair_count": 2},
     [0.1, 0.1, 0.55, 0.55, 1.0, 0.55, 0.55, 0.1, 0.1, 0.1]),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2}, [1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3]),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 2.0,
                     "lr_range_test_staircase": True}, [1e-3, 1e-3, 3e-3, 3e-3, 5e-3, 5e-3]),
])
def test_schedules_follow_deepspeeds_formulas_step_by_step(kind, params, expected):
    assert lrs(kind, params, len(expected) - 1) == pytest.approx(expected, abs=1e-12)


def test_warmup_defaults_come_from_the_optimizer_and_deepspeed():
    assert lrs("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}, 3, lr=0.4) == pytest.approx(
        [0.0, 0.0, 0.2, 0.4])  # warmup_max_lr absent: the optimizer's lr
    assert lrs("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 2, "warmup_type": "linear"}, 3,
               lr=0.4)[-1] == pytest.approx(0.001)  # WarmupDecayLR's own default max is 0.001
    assert lrs("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 2, "warmup_type": "linear"}, 1,
               lr=0.4) == pytest.approx([0.0, 0.0])  # warmup_min_ratio 0, then ratios of the optimizer's 0.4


def test_per_group_values_and_errors():
    weights = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    opt = torch.optim.SGD([{"params": [weights[0]]}, {"params": [weights[1]]}], lr=1.0)
    spec = SchedulerSpec(type="WarmupLR", params={"warmup_min_lr": [0.0, 0.5], "warmup_max_lr": [1.0, 2.0],
                                                  "warmup_num_steps": 2, "warmup_type": "linear"})
    schedule = build_scheduler(spec, opt)[0]
    opt.step()
    schedule.step()
    opt.step()
    schedule.step()
    assert schedule.get_last_lr() == pytest.approx([0.5, 1.25])
    one_group = torch.optim.SGD([weights[0]], lr=1.0)
    with pytest.raises(ValueError, match="warmup_min_lr has 2 values but the optimizer has 1 parameter groups"):
        build_scheduler(spec, one_group)
    with pytest.raises(ValueError, match="warmup_num_steps=0 must be a positive whole number"):
        build_scheduler(SchedulerSpec(type="WarmupLR", params={"warmup_num_steps": 0}), one_group)
    with pytest.raises(ValueError, match="last_batch_iteration=5 is not supported"):
        SchedulerSpec(type="WarmupLR", params={"last_batch_iteration": 5})


def test_one_cycle_cycles_adam_betas_and_skips_sgd():
    params = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "cycle_min_mom": 0.85,
              "cycle_max_mom": 0.95}
    weight = torch.nn.Parameter(torch.zeros(2))
    adam = torch.optim.AdamW([weight], lr=1.0)
    schedule = build_scheduler(SchedulerSpec(type="OneCycle", params=params), adam)[0]
    betas = [adam.param_groups[0]["betas"]]
    for _ in range(9):
        adam.step()
        schedule.step()
        betas.append(adam.param_groups[0]["betas"])
    # construction: the minimum; then max - (max - min) x scale; after the cycle: the maximum (no decay)
    assert [b[0] for b in betas] == pytest.approx([0.85, 0.925, 0.9, 0.875, 0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert {b[1] for b in betas} == {0.99}
    sgd = torch.optim.SGD([weight], lr=1.0, momentum=0.9)
    assert not build_scheduler(SchedulerSpec(type="OneCycle", params=params), sgd)[0].cycle_momentum


def test_schedule_state_round_trips():
    spec = SchedulerSpec(type="WarmupDecayLR", params={"total_num_steps": 20, "warmup_num_steps": 5})
    weight = torch.nn.Parameter(torch.zeros(1))
    first, second = torch.optim.SGD([weight], lr=1.0), torch.optim.SGD([weight], lr=1.0)
    a, b = build_scheduler(spec, first)[0], build_scheduler(spec, second)[0]
    for _ in range(7):
        first.step()
        a.step()
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        first.step()
        a.step()
        second.step()
        b.step()
    assert b.get_last_lr() == a.get_last_lr() and isinstance(b, DeepSpeedLR)


# --- optimizers ------------------------------------------------------------------------------------

def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                               torch.nn.Conv1d(4, 4, 3), torch.nn.Linear(4, 10))


def group_settings(optimizer: torch.optim.Optimizer, *names: str) -> dict:
    return {name: optimizer.param_groups[0][name] for name in names}


@pytest.mark.parametrize("block, cls, settings", [
    ({"type": "Adam", "params": {"lr": 0.1}}, torch.optim.AdamW,  # adam_w_mode is DeepSpeed's default
     {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
    ({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}, torch.optim.Adam,
     {"lr": 1e-3, "weight_decay": 0.01}),
    ({"type": "AdamW"}, torch.optim.AdamW, {"weight_decay": 0.0}),  # FusedAdam's 0, not torch AdamW's 0.01
    ({"type": "AdamW", "params": {"amsgrad": True, "torch_adam": True}}, torch.optim.AdamW, {"amsgrad": True}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, torch.optim.SGD,
     {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0}),
    ({"type": "SGD"}, torch.optim.SGD, {"lr": 1e-3}),
    ({"type": "Adagrad", "params": {"lr_decay": 0.1}}, torch.optim.Adagrad, {"lr": 1e-2, "lr_decay": 0.1,
                                                                            "eps": 1e-10}),
])
def test_optimizer_blocks_build_torch_optimizers(block, cls, settings):
    optimizers = build_optimizer(OptimizerSpec(**block), model())
    assert len(optimizers) == 1 and type(optimizers[0]) is cls
    assert group_settings(optimizers[0], *settings) == settings


@pytest.mark.parametrize("block, fused", [
    ({"type": "AdamW"}, True), ({"type": "Adam", "params": {"adam_w_mode": False}}, True), ({"type": "SGD"}, True),
    ({"type": "Adagrad"}, None),  # torch's fused Adagrad is CPU-only; the masters may live on a GPU
    ({"type": "AdamW", "params": {"foreach": True}}, None), ({"type": "AdamW", "params": {"fused": False}}, False),
    ({"type": "SGD", "params": {"differentiable": True}}, None),
])
def test_blocks_use_torchs_fused_kernel_unless_they_choose_another(block, fused):
    """See [Note: fused optimizer kernels] in zerokit/engine/schedules.py."""
    optimizers = build_optimizer(OptimizerSpec(**block), model())
    assert [group["fused"] for group in optimizers[0].param_groups] == [fused]
    muon, adam = build_optimizer(OptimizerSpec(type="Muon"), model())
    assert adam.param_groups[0]["fused"] and "fused" not in muon.defaults


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    net = model()
    muon, adam = build_optimizer(OptimizerSpec(type="Muon", params={"lr": 0.05, "adam_lr": 1e-3,
                                                                   "weight_decay": 0.01}), net)
    assert type(muon) is torch.optim.Muon and type(adam) is torch.optim.AdamW
    in_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    assert in_muon == {id(net[1].weight), id(net[4].weight)}  # not the embedding, the norm, biases or the conv
    assert len(in_muon) + sum(len(g["params"]) for g in adam.param_groups) == len(list(net.parameters()))
    assert group_settings(muon, "lr", "momentum", "weight_decay", "nesterov") == {
        "lr": 0.05, "momentum": 0.95, "weight_decay": 0.01, "nesterov": True}
    assert group_settings(adam, "lr", "betas", "eps", "weight_decay") == {
        "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.01}


def test_muon_keeps_param_group_settings_and_names_lm_head():
    net = model()
    named = [("lm_head.weight", net[4].weight), ("blocks.0.weight", net[1].weight), ("blocks.0.bias", net[1].bias)]
    groups = [{"params": named[:2], "weight_decay": 0.0}, {"params": named[2:], "lr": 0.5}]
    optimizers = build_optimizer(OptimizerSpec(type="Muon", params={"adam_w_mode": False}), groups)
    muon, adam = optimizers
    assert [p is net[1].weight for p in muon.param_groups[0]["params"]] == [True]
    assert muon.param_groups[0]["weight_decay"] == 0.0 and muon.param_groups[0]["lr"] == 0.02
    assert type(adam) is torch.optim.Adam and [g["lr"] for g in adam.param_groups] == [3e-4, 0.5]


def test_optimizer_builds_over_plain_tensors():
    weight = torch.nn.Parameter(torch.zeros(3, 3))
    optimizers = build_optimizer(OptimizerSpec(type="Muon"), [weight])
    assert [type(o) for o in optimizers] == [torch.optim.Muon]


def test_both_given_is_one_line():
    for kind, words in (("optimizer", "an optimizer and the config has an 'optimizer' block"),
                        ("scheduler", "an lr_scheduler and the config has a 'scheduler' block")):
        message = str(both_given_error(kind))
        assert words in message and "\n" not in message
