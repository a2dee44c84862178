"""The engine in one plain process (world size 1) and under a fake 1024-rank group: user errors,
and shard arithmetic at a world size CI cannot spawn."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import zerokit
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups


def tiny() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig())


def test_plain_process_trains_with_world_size_one(one_process) -> None:
    model = tiny()
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2),
                                {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2})
    assert dist.get_world_size() == 1
    tokens = torch.randint(0, 67, (4, 17))
    results = []
    for _ in range(6):
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        results.append(engine.step())
    assert [r.stepped for r in results] == [False, True] * 3  # steps only at accumulation boundaries
    assert results[-1].optimizer_step == 3 and results[-1].grad_norm > 0
    assert lm_loss(engine(tokens[:, :-1]), tokens).item() < lm_loss(tiny()(tokens[:, :-1]), tokens).item()


@pytest.mark.parametrize("mistake,message", [
    ("foreign", "holds a parameter of shape (3,) that is not in the model"),
    ("orphan", "requires grad but is in no optimizer param group"),
    ("stateful", "already has state"),
])
def test_optimizer_mistakes_are_named(one_process, mistake, message) -> None:
    model = tiny()
    groups = param_groups(model)
    if mistake == "foreign":
        groups[1]["params"].append(torch.nn.Parameter(torch.zeros(3)))
    if mistake == "orphan":
        groups[1]["params"] = groups[1]["params"][:-1]
    optimizer = torch.optim.AdamW(groups)
    if mistake == "stateful":
        optimizer.state[groups[0]["params"][0]]["step"] = torch.tensor(1.0)
    with pytest.raises(ValueError) as error:
        zerokit.initialize(model, optimizer, {"zero_optimization": {"stage": 1}})
    assert message in str(error.value)


def test_fake_1024_ranks_shard_as_the_formula_says(one_process) -> None:
    """Construction and accounting at N=1024 with torch's fake backend (collectives do nothing)."""
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=1024)
    for stage in (0, 1, 2):
        model = tiny()
        engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model)),
                                    {"zero_optimization": {"stage": stage, "reduce_bucket_bytes": 2**30},
                                     "bf16": {"enabled": True}})
        padded = engine.stage.layout.numel
        shards = 1 if stage == 0 else 1024
        assert padded % shards == 0 and padded - engine.trainable_numel() < 2 * shards  # 2 buckets (2 groups)
        assert engine.memory_stats()["gradients"] == 0  # made at a window's first backward (stages/base.py)
        tokens = torch.randint(0, 67, (2, 9), generator=torch.Generator().manual_seed(0))
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        memory = engine.memory_stats()
        flags = len(engine.stage.flat.params) if stage == 0 else 0  # stage 0's usage flags follow its gradients
        reduced = 4 * padded // shards  # the owned gradients in fp32 (the reduce dtype) until the step
        assert memory["gradients"] == (2 * (padded + flags) if stage < 2 else 0) + reduced
        assert memory["optimizer_state"] == 4 * padded // shards  # fp32 masters; Adam state starts at the 1st step
        assert sum(m.numel() for m in engine.stage.masters) == padded // shards


def test_step_without_backward_is_refused(one_process) -> None:
    """A second step() after one backward() would step the optimizer again on stale gradients."""
    model = tiny()
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model)), {"zero_optimization": {"stage": 1}})
    tokens = torch.randint(0, 67, (2, 17))
    with pytest.raises(RuntimeError, match="without an engine.backward"):
        engine.step()
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
    assert engine.step().stepped
    with pytest.raises(RuntimeError, match="without an engine.backward"):
        engine.step()


@pytest.mark.parametrize("stage", [1, 3])
def test_write_back_keeps_only_edits_and_leaves_other_masters_in_fp32(one_process, stage) -> None:
    model = tiny()
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model)),
                                {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    before = [m.detach().clone() for m in engine.stage.masters]
    assert any(not torch.equal(m, m.bfloat16().float()) for m in before)  # masters carry fp32 bits
    with engine.unsharded(write_back=True):
        pass  # no edit: nothing may change
    assert all(torch.equal(m, b) for m, b in zip(engine.stage.masters, before))
    with engine.unsharded([model.ln_f.bias], write_back=True), torch.no_grad():
        model.ln_f.bias.fill_(0.25)
    with engine.unsharded([model.ln_f.bias]):
        assert torch.equal(model.ln_f.bias, torch.full_like(model.ln_f.bias, 0.25))
    changed = sum(int((m != b).sum()) for m, b in zip(engine.stage.masters, before))
    assert changed == model.ln_f.bias.numel()  # exactly the edited elements, now 0.25 in the master too


class Rotary(torch.nn.Module):
    """Owns a buffer and no parameters, like Hugging Face's rotary embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10_000 ** (torch.arange(0, 8, 2) / 8), persistent=False)


class WithRotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.rotary = Rotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.rotary.inv_freq.repeat(2)


def test_meta_buffers_of_parameterless_modules_are_initialised_or_refused(one_process) -> None:
    expected = Rotary().inv_freq

    def param_init(module: torch.nn.Module) -> None:
        if isinstance(module, Rotary):
            module.inv_freq.copy_(expected)
        else:
            module.reset_parameters()

    config = {"zero_optimization": {"stage": 3}}
    with torch.device("meta"):
        model = WithRotary()
    zerokit.initialize(model, torch.optim.AdamW(model.parameters()), config, param_init=param_init)
    assert torch.equal(model.rotary.inv_freq, expected)
    with torch.device("meta"):
        model = WithRotary()
    with pytest.raises(ValueError, match="Rotary was built on the meta device and has no reset_parameters"):
        zerokit.initialize(model, torch.optim.AdamW(model.parameters()), config)


def test_stage2_counts_full_gradients_held_while_accumulating_locally(one_process) -> None:
    model = tiny()
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model)),
                                {"zero_optimization": {"stage": 2, "reduce_every_micro_step": False},
                                 "gradient_accumulation_steps": 2})
    tokens = torch.randint(0, 67, (2, 17))
    assert engine.memory_stats()["gradients"] == 0  # the shard is made at the window's first reduction
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))  # off the boundary: gradients stay whole
    full = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert engine.memory_stats()["gradients"] == full
    engine.step()
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))  # the boundary: reduced, full ones freed
    assert engine.memory_stats()["gradients"] == 4 * engine.stage.local.numel  # this rank's fp32 shard
    engine.step()
    assert engine.memory_stats()["gradients"] == 0  # let go of at the step
