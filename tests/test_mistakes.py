"""Issue 15: mistakes a user makes that used to train wrong in silence each get a clear error, or the right result
(DDP's for buffers, eager training's for torch.compile), on 2 gloo ranks. A different learning rate or clipping
per rank is caught by the start-up fingerprint: see tests/test_reliability.py (DISAGREEMENTS)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerokit
from zerokit.reliability.compiled import compile_model
from zerokit.reliability.mistakes import refuse_wrapped
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups, rank_batch, small_zero_config
from zerokit.testing.spawn import spawn

SPAWN_TIMEOUT = 300
STAGES = (0, 1, 2, 3)


def tiny(**options) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(**options))


def train_step(engine: zerokit.Engine, rank: int, step: int) -> float:
    tokens = rank_batch(rank, step)
    loss = lm_loss(engine(tokens[:, :-1]), tokens)
    engine.backward(loss)
    engine.step()
    return loss.item()


def error_of(action) -> str | None:
    try:
        action()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


# --- one spawn for the errors ----------------------------------------------------------------------------
def _wrapped_models(rank: int) -> dict[str, str | None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    made = {"DDP": lambda: nn.parallel.DistributedDataParallel(tiny()),
            "FSDP2": lambda: fully_shard(tiny(), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))}
    outcomes = {}
    for name, make in made.items():
        for stage in (0, 2):
            model = make()
            outcomes[f"{name}-stage{stage}"] = error_of(
                lambda: zerokit.initialize(model, torch.optim.AdamW(model.parameters()), small_zero_config(stage)))
    # DDP on rank 0 only: rank 0 names it, rank 1 names rank 0's problem (not a timeout)
    alone = dist.new_group([0])  # DDP's construction is a collective of its group: rank 0's own
    model = nn.parallel.DistributedDataParallel(tiny(), process_group=alone) if rank == 0 else tiny()
    outcomes["DDP-rank0-only"] = error_of(lambda: zerokit.initialize(model, torch.optim.AdamW(model.parameters()),
                                                                     small_zero_config(0)))
    return outcomes


def _requires_grad_changes(rank: int) -> dict[str, str | None]:
    outcomes = {}
    for stage in STAGES:
        model = tiny()
        engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-3), small_zero_config(stage))
        train_step(engine, rank, 0)
        weight = model.blocks[0].attn.qkv.weight
        weight.requires_grad_(False)
        outcomes[f"frozen-stage{stage}"] = error_of(lambda: train_step(engine, rank, 1))
        weight.requires_grad_(True)
        model.frozen.weight.requires_grad_(True)
        outcomes[f"unfrozen-stage{stage}"] = error_of(lambda: train_step(engine, rank, 1))
        model.frozen.weight.requires_grad_(False)
        outcomes[f"restored-stage{stage}"] = error_of(lambda: train_step(engine, rank, 1))
    return outcomes


def _backward_twice(rank: int) -> dict[str, str | None]:
    outcomes = {}
    for stage in STAGES:
        for accumulation in (1, 2):
            model = tiny()
            engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-3),
                                        small_zero_config(stage, gradient_accumulation_steps=accumulation))
            backwards = []

            def backward(step: int) -> None:
                tokens = rank_batch(rank, step)
                engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
                backwards.append(step)

            error = error_of(lambda: [backward(step) for step in range(accumulation + 1)])
            outcomes[f"stage{stage}-accumulation{accumulation}"] = (error, len(backwards))
    return outcomes


def _at_initialize(rank: int) -> dict[str, str | None]:
    frozen = tiny()
    frozen.requires_grad_(False)
    model = tiny()
    return {
        "nothing to train": error_of(lambda: zerokit.initialize(frozen, torch.optim.AdamW(frozen.parameters()),
                                                                small_zero_config(2))),
        "train_batch_size": error_of(lambda: zerokit.initialize(model, torch.optim.AdamW(model.parameters()),
                                                                small_zero_config(2, train_batch_size=3))),
    }


def _errors(rank: int, world_size: int) -> dict:
    return {"wrapped": _wrapped_models(rank), "requires_grad": _requires_grad_changes(rank),
            "backward": _backward_twice(rank), "initialize": _at_initialize(rank)}


@functools.lru_cache(maxsize=None)
def errors() -> list[dict]:
    return spawn(_errors, 2, timeout=SPAWN_TIMEOUT)


WRAPPED = re.compile(r"ValueError: zerokit.initialize got a model wrapped in (?P<kind>[^:]+): .*; pass the plain "
                     r"module \((?P<how>[^)]+)\)$")


@pytest.mark.parametrize("name,kind", [("DDP", "torch DistributedDataParallel"), ("FSDP2", "FSDP2 (fully_shard)")])
@pytest.mark.parametrize("stage", [0, 2])
def test_a_wrapped_model_is_refused_at_initialize(name: str, kind: str, stage: int) -> None:
    for outcomes in errors():
        message = outcomes["wrapped"][f"{name}-stage{stage}"]
        match = WRAPPED.match(message or "")
        assert match and match["kind"] == kind and "\n" not in message, message


def test_a_model_wrapped_on_one_rank_is_named_on_every_rank() -> None:
    rank0, rank1 = (outcomes["wrapped"]["DDP-rank0-only"] for outcomes in errors())
    assert WRAPPED.match(rank0) and "ddp_model.module" in rank0
    assert rank1.startswith("RanksDisagreeError: zerokit.initialize: the ranks disagree on start-up checks: rank 0: "
                            "'zerokit.initialize got a model wrapped in torch DistributedDataParallel")
    assert "; rank 1: 'passed'" in rank1


def instance_of(cls: type) -> nn.Module:
    """An instance of a wrapper's real class around a TinyGPT, without its constructor: FSDP (1) needs an accelerator,
    DeepSpeed's engine seconds of set-up; the check at initialize looks at the class."""
    wrapper = cls.__new__(cls)
    nn.Module.__init__(wrapper)
    wrapper.module = tiny()
    return wrapper


def test_an_fsdp_model_is_refused() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    with pytest.raises(ValueError, match=r"^zerokit.initialize got a model wrapped in FSDP \(FullyShardedDataParallel\): "
                                         r"it shards the parameters zerokit shards; pass the plain module \(build it "
                                         r"without FSDP\)$"):
        refuse_wrapped(instance_of(FullyShardedDataParallel))


def test_a_deepspeed_engine_is_refused() -> None:
    engine_module = pytest.importorskip("deepspeed.runtime.engine")
    with pytest.raises(ValueError, match=r"wrapped in a DeepSpeed engine: .*pass the plain module "
                                         r"\(deepspeed_engine.module\)$"):
        refuse_wrapped(instance_of(engine_module.DeepSpeedEngine))


@pytest.mark.parametrize("stage", STAGES)
def test_requires_grad_changed_after_initialize_is_named_at_the_next_backward(stage: int) -> None:
    for outcomes in errors():
        changed = outcomes["requires_grad"]
        assert changed[f"frozen-stage{stage}"] == (
            "RuntimeError: parameter 'blocks.0.attn.qkv.weight' was frozen (requires_grad set to False) after "
            "zerokit.initialize, which fixed what trains: its optimizer state and weight decay would keep moving it; "
            "set requires_grad before zerokit.initialize, or initialize a new engine after changing it")
        assert changed[f"unfrozen-stage{stage}"].startswith(
            "RuntimeError: parameter 'frozen.weight' was unfrozen (requires_grad set to True) after zerokit.initialize")
        assert changed[f"restored-stage{stage}"] is None  # set back, training goes on


@pytest.mark.parametrize("stage", STAGES)
def test_a_second_backward_before_step_raises_outside_an_accumulation_window(stage: int) -> None:
    for outcomes in errors():
        error, done = outcomes["backward"][f"stage{stage}-accumulation1"]
        assert done == 1 and error.startswith("RuntimeError: engine.backward() was called again after the backward "
                                              "that ended an accumulation window (gradient_accumulation_steps=1)")
        error, done = outcomes["backward"][f"stage{stage}-accumulation2"]
        assert done == 2 and "gradient_accumulation_steps=2" in error  # two backwards accumulate; a third raises


def test_nothing_to_train_and_an_indivisible_batch_are_refused_at_initialize() -> None:
    for outcomes in errors():
        assert outcomes["initialize"]["nothing to train"].startswith(
            "ValueError: the model has no parameter with requires_grad=True (")
        assert outcomes["initialize"]["train_batch_size"] == (
            "ValueError: train_batch_size=3 cannot be split over 1 accumulation steps x 2 ranks (3 is not a "
            "multiple of 2)")


def test_accumulating_backwards_then_one_step_is_what_the_config_asks() -> None:
    """Within a window, backward twice then step() once is gradient accumulation: the step is taken."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny()
        engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model)), small_zero_config(2, gradient_accumulation_steps=2))
        for step in range(2):
            tokens = rank_batch(0, step)
            engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        assert engine.step().stepped
    finally:
        dist.destroy_process_group()


# --- buffers, beside torch DDP ---------------------------------------------------------------------------
class Normed(nn.Module):
    """A BatchNorm between two linear layers: its running statistics are buffers each rank updates from its data."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.out = nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def normed_data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(16, 8, generator=generator) * (1 + rank), torch.randn(16, 4, generator=generator)


def train_normed(model: nn.Module, step_fn, rank: int, steps: int = 4) -> dict:
    """Train, then one eval forward (BatchNorm reads its running statistics); what each rank then holds."""
    for step in range(steps):
        x, y = normed_data(rank, step)
        step_fn(nn.functional.mse_loss(model(x), y))
    model.eval()
    with torch.no_grad():
        output = model(normed_data(9, 0)[0])
    return {"output": output}


def _buffers(rank: int, world_size: int) -> dict:
    ddp = nn.parallel.DistributedDataParallel(Normed())  # its default: rank 0's buffers before each forward
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    def ddp_step(loss: torch.Tensor) -> None:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    outcomes = {"ddp": train_normed(ddp, ddp_step, rank)}
    outcomes["ddp"]["state"] = {name: value.detach().clone() for name, value in ddp.module.state_dict().items()}
    for stage in STAGES:
        for broadcast in (True, False):
            model = Normed()
            engine = zerokit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                        small_zero_config(stage, broadcast_buffers=broadcast))
            before = engine.comm_stats()["broadcast"]["calls"]

            def zerokit_step(loss: torch.Tensor) -> None:
                engine.backward(loss)
                engine.step()
            outcome = train_normed(model, zerokit_step, rank)
            outcome["broadcasts"] = engine.comm_stats()["broadcast"]["calls"] - before
            outcome["state"] = engine.full_state_dict()  # at stage 3 the module's own parameters are shards now
            outcomes[f"stage{stage}-{broadcast}"] = outcome
    return outcomes


@functools.lru_cache(maxsize=None)
def buffers() -> list[dict]:
    return spawn(_buffers, 2, timeout=SPAWN_TIMEOUT)


@pytest.mark.parametrize("stage", STAGES)
def test_buffers_stay_equal_to_rank_0s_as_ddp_keeps_them(stage: int) -> None:
    ranks = buffers()
    for outcomes in ranks:
        ours, ddp = outcomes[f"stage{stage}-True"], outcomes["ddp"]
        torch.testing.assert_close(ours["state"], ddp["state"], rtol=1e-5, atol=1e-6)  # weights and buffers
        torch.testing.assert_close(ours["output"], ddp["output"], rtol=1e-5, atol=1e-6)  # eval: same everywhere
        torch.testing.assert_close(ours["state"], ranks[0][f"stage{stage}-True"]["state"], rtol=0, atol=0)
        # counted: one broadcast per buffer dtype (float32 statistics, int64 batch count) before the first forward,
        # as DDP does, and one per training step; the eval forward after a step has nothing to do
        assert ours["broadcasts"] == (1 + 4) * 2


@pytest.mark.parametrize("stage", STAGES)
def test_broadcast_buffers_false_leaves_each_rank_its_own(stage: int) -> None:
    rank0, rank1 = (outcomes[f"stage{stage}-False"] for outcomes in buffers())
    assert rank0["broadcasts"] == rank1["broadcasts"] == 0
    assert not torch.equal(rank0["state"]["norm.running_mean"], rank1["state"]["norm.running_mean"])


# --- torch.compile ---------------------------------------------------------------------------------------
def _compiled(rank: int, world_size: int) -> dict:
    """Eager, then the same training with the model compiled whole (torch.compile wrapper), in place
    (engine.compile's way), and per block; aot_eager: dynamo and AOTAutograd without code generation."""
    outcomes = {}
    for stage in STAGES:
        for how in ("eager", "whole", "in place", "blocks") if stage in (0, 3) else ("eager", "whole"):
            model = tiny(n_layer=2)
            module = torch.compile(model, backend="aot_eager") if how == "whole" else model
            if how == "blocks":
                for block in model.blocks:
                    block.compile(backend="aot_eager")
            engine = zerokit.initialize(module, torch.optim.AdamW(param_groups(model), lr=1e-3), small_zero_config(stage))
            if how == "in place":
                compile_model(engine, backend="aot_eager")
            losses = [train_step(engine, rank, step) for step in range(3)]
            state = {name.replace("_orig_mod.", ""): value for name, value in engine.full_state_dict().items()}
            outcomes[f"stage{stage}-{how}"] = {"losses": losses, "state": state}
    model = tiny()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    outcomes["fullgraph"] = error_of(lambda: zerokit.initialize(compiled, torch.optim.AdamW(model.parameters()),
                                                                small_zero_config(3)))
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters()), small_zero_config(3))
    outcomes["engine.compile fullgraph"] = error_of(lambda: compile_model(engine, backend="aot_eager", fullgraph=True))
    return outcomes


@functools.lru_cache(maxsize=None)
def compiled() -> list[dict]:
    return spawn(_compiled, 2, timeout=SPAWN_TIMEOUT)


@pytest.mark.parametrize("stage", STAGES)
def test_a_compiled_model_trains_as_eager_at_every_stage(stage: int) -> None:
    for outcomes in compiled():
        eager = outcomes[f"stage{stage}-eager"]
        for how in ("whole", "in place", "blocks") if stage in (0, 3) else ("whole",):
            assert outcomes[f"stage{stage}-{how}"]["losses"] == eager["losses"], how
            torch.testing.assert_close(outcomes[f"stage{stage}-{how}"]["state"], eager["state"], rtol=0, atol=0)


def test_fullgraph_around_stage3_units_says_what_to_compile_instead() -> None:
    for outcomes in compiled():
        assert outcomes["fullgraph"].startswith("ValueError: the model is compiled with fullgraph=True around "
                                                "stage-3 unit '_orig_mod.blocks.0'")
        assert "compile each unit instead (e.g. model.blocks[i] = torch.compile(model.blocks[i], fullgraph=True)" \
            in outcomes["fullgraph"] and "\n" not in outcomes["fullgraph"]
        assert outcomes["engine.compile fullgraph"].startswith(
            "ValueError: engine.compile() would compile the model with fullgraph=True around stage-3 unit 'blocks.0'")
