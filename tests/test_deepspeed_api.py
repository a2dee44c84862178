"""zerokit.deepspeed in one process: DeepSpeed's initialize() arguments, checks and messages, the engine's
DeepSpeed methods and counters, schedulers passed in, zero.Init / GatheredParameters, comm, the accelerator,
compile() at stages 0-2, checkpoints with the schedule, and the one-line refusals of what is out of scope.
Two ranks: tests/test_deepspeed_scripts.py."""

from __future__ import annotations

import argparse
import importlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerokit
import zerokit.deepspeed as deepspeed
import zerokit.deepspeed.comm as ds_comm
from zerokit.deepspeed.accelerator import get_accelerator
from zerokit.engine.schedules import warmup_decay_lr
from zerokit.testing.spawn import spawn


@pytest.fixture
def one_process(monkeypatch):
    """A fresh 1-rank group, and LOCAL_RANK as torchrun would set it (restored after)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    monkeypatch.setenv("LOCAL_RANK", "0")
    yield
    for engine in deepspeed.engine.live_engines():
        engine.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(11, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 11))


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


TOKENS = torch.randint(0, 11, (4, 9), generator=torch.Generator().manual_seed(5))
BLOCKS = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                            "warmup_num_steps": 2, "total_num_steps": 5,
                                                            "warmup_type": "linear"}}}


def config(stage: int = 1, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": stage}, **extra}


# --- initialize: arguments, checks, messages ------------------------------------------------------------

def test_add_config_arguments_reads_the_deepspeed_flags() -> None:
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and args.deepscale_config is None


@pytest.mark.parametrize("args,config,message", [
    (argparse.Namespace(deepspeed_config="a.json"), {"train_batch_size": 1},
     "Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments and deepspeed.initialize() "
     "function call"),
    (argparse.Namespace(), None, "DeepSpeed requires --deepspeed_config to specify configuration file"),
    (argparse.Namespace(deepspeed_config="a.json", deepscale_config="b.json"), None,
     "Not sure how to proceed, we were given both a deepscale_config and deepspeed_config"),
])
def test_config_source_errors_are_deepspeeds(one_process, args, config, message) -> None:
    with pytest.raises(ValueError) as error:
        deepspeed.initialize(args=args, model=small_model(), config=config)
    assert str(error.value) == message


def test_local_rank_must_agree_with_the_environment(one_process) -> None:
    with pytest.raises(ValueError) as error:
        deepspeed.initialize(args=argparse.Namespace(local_rank=1), model=small_model(), config=config(**BLOCKS))
    assert str(error.value) == "Mismatch in local rank setting, args.local_rank=1 but env['LOCAL_RANK']=0."
    args = argparse.Namespace(local_rank=-1, deepspeed_config=None)
    engine, *_ = deepspeed.initialize(args=args, model=small_model(), config=config(**BLOCKS))
    assert args.local_rank == engine.local_rank == 0 and engine.global_rank == 0 and engine.world_size == 1


@pytest.mark.parametrize("given,message", [
    ("optimizer", "initialize() got an optimizer and the config has an 'optimizer' block; remove one"),
    ("lr_scheduler", "initialize() got an lr_scheduler and the config has a 'scheduler' block; remove one"),
])
def test_an_object_and_a_block_for_it_is_an_error(one_process, given, message) -> None:
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = {"optimizer": optimizer} if given == "optimizer" else {
        "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}
    with pytest.raises(ValueError) as error:
        deepspeed.initialize(model=model, config=config(**BLOCKS), **objects)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_initialize_returns_deepspeeds_four_and_the_engine_answers_as_deepspeed(one_process) -> None:
    model = small_model()
    data = torch.utils.data.TensorDataset(TOKENS.repeat(3, 1))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=(p for p in model.parameters()), training_data=data, config=config(**BLOCKS))
    assert isinstance(engine, zerokit.Engine) and engine.module is model
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer is engine.optimizer
    assert scheduler is engine.lr_scheduler and len(loader) == 6 and loader.batch_size == 2
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.zero_optimization_stage(), engine.fp16_enabled(), engine.bfloat16_enabled()) == (4, 2, 2, 1, False,
                                                                                                 False)
    lrs, boundaries = [], []
    for (tokens,) in loader:
        loss = lm_loss(engine, tokens)
        returned = engine.backward(loss)
        assert returned.item() == pytest.approx(loss.item() / 2)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert boundaries == [False, True] * 3 and engine.global_steps == 3 and engine.global_samples == 12
    expected = [warmup_decay_lr(step // 2 - 1 + (step % 2 == 1), 0.0, 0.01, 2, "linear", 5) if step % 2 else None
                for step in range(6)]
    assert [lr for lr, want in zip(lrs, expected) if want is not None] == pytest.approx(
        [want for want in expected if want is not None])
    assert engine.get_global_grad_norm() > 0 and engine.was_step_applied()


def test_a_callable_optimizer_gets_model_parameters(one_process) -> None:
    model = small_model()
    seen = []

    def make(params):
        seen.append(params)
        return torch.optim.SGD(params, lr=0.1)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=make, config=config(),
                                                           model_parameters=iter(list(model.parameters())))
    assert isinstance(seen[0], list) and len(seen[0]) == 5 and isinstance(optimizer, torch.optim.SGD)
    assert scheduler is None


def test_a_scheduler_built_before_initialize_drives_the_optimizer_that_trains(one_process) -> None:
    """See [Note: a scheduler passed to initialize] in zerokit/deepspeed/engine.py."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                                   config=config(stage=2))
    assert scheduler is schedule
    lrs = []
    for _ in range(4):
        engine.backward(lm_loss(engine, TOKENS))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.025])  # stepped at the two optimizer steps only
    assert engine.optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_zero_grad_refuses_inside_a_window_only(one_process) -> None:
    engine, *_ = deepspeed.initialize(model=small_model(), config=config(**BLOCKS))
    engine.zero_grad()
    engine.backward(lm_loss(engine, TOKENS))
    with pytest.raises(RuntimeError, match="inside an accumulation window would drop"):
        engine.zero_grad()


# --- compile, checkpoints, teardown ----------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compile_trains_as_eager_does(one_process, stage: int) -> None:
    losses = {}
    for compiled in (False, True):
        engine, *_ = deepspeed.initialize(model=small_model(), config=config(stage=stage,
                                                                            optimizer=BLOCKS["optimizer"]))
        if compiled:
            engine.compile()
            assert engine.is_compiled and engine.module._compiled_call_impl is not None
        losses[compiled] = []
        for _ in range(4):
            loss = lm_loss(engine, TOKENS)
            engine.backward(loss)
            engine.step()
            losses[compiled].append(loss.item())
        engine.destroy()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[True][-1] < losses[True][0]


def test_compile_refusals(one_process) -> None:
    engine, *_ = deepspeed.initialize(model=small_model(), config=config(stage=1, **BLOCKS))
    with pytest.raises(ValueError, match="asks for DeepCompile"):
        engine.compile(schedule=[(0, "pass")])
    with pytest.raises(ValueError, match="compiled_autograd_enabled=True"):
        engine.compile(compiled_autograd_enabled=True)
    stage3, *_ = deepspeed.initialize(model=small_model(1), config=config(stage=3, zero_optimization={
        "stage": 3, "stage3_min_unit_params": 100, "stage3_param_persistence_threshold": 0}, **BLOCKS))
    with pytest.raises(ValueError, match=r"^engine.compile\(\) would compile the model with fullgraph=True around stage-3 unit"):
        stage3.compile(compile_kwargs={"fullgraph": True})


def test_checkpoint_keeps_the_schedule(one_process, tmp_path) -> None:
    engine, *_ = deepspeed.initialize(model=small_model(), config=config(stage=2, **BLOCKS))
    for _ in range(4):
        engine.backward(lm_loss(engine, TOKENS))
        engine.step()
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3})
    continued = []
    for _ in range(4):
        engine.backward(lm_loss(engine, TOKENS))
        engine.step()
        continued.append(engine.get_lr()[0])
    resumed, *_ = deepspeed.initialize(model=small_model(7), config=config(stage=2, **BLOCKS))
    path, client_state = resumed.load_checkpoint(tmp_path)
    assert client_state == {"epoch": 3} and path.endswith("global_step2")
    again = []
    for _ in range(4):
        resumed.backward(lm_loss(resumed, TOKENS))
        resumed.step()
        again.append(resumed.get_lr()[0])
    assert again == continued


def test_destroy_removes_the_hooks(one_process) -> None:
    model = small_model()
    engine, *_ = deepspeed.initialize(model=model, config=config(**BLOCKS))
    engine.destroy()
    assert engine not in deepspeed.engine.live_engines()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


# --- zero.Init, GatheredParameters -------------------------------------------------------------------------

def test_zero_init_builds_on_the_meta_device_at_stage_3_only(one_process) -> None:
    with deepspeed.zero.Init(config_dict_or_path=config(stage=3)):
        meta = small_model()
    with deepspeed.zero.Init(config_dict_or_path=config(stage=2)):
        real = small_model()
    assert all(p.is_meta for p in meta.parameters()) and not any(p.is_meta for p in real.parameters())
    engine, *_ = deepspeed.initialize(model=meta, config=config(stage=3, **BLOCKS))
    engine.backward(lm_loss(engine, TOKENS))
    engine.step()
    with deepspeed.zero.GatheredParameters(list(meta.parameters())):
        assert all(torch.isfinite(p).all() for p in meta.parameters())


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_parameters_keeps_what_the_modifier_rank_wrote(one_process, stage: int) -> None:
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step publishes the masters unchanged
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage=stage))
    bias = model[3].bias
    with deepspeed.zero.GatheredParameters(bias, modifier_rank=0):
        with torch.no_grad():
            bias.fill_(0.5)
    for _ in range(2):
        engine.backward(lm_loss(engine, TOKENS))
        engine.step()
    assert torch.equal(engine.full_state_dict()["3.bias"], torch.full((11,), 0.5))
    with deepspeed.zero.GatheredParameters(small_model().parameters()):  # nobody's: left as they are
        pass


def test_zero_init_refuses_what_zerokit_does_not_offer() -> None:
    with pytest.raises(ValueError, match=r"^zero.Init\(remote_device='cpu'\) is not offered"):
        deepspeed.zero.Init(remote_device="cpu")
    with pytest.raises(ValueError, match="ZeRO\\+\\+ quantized weights"):
        deepspeed.zero.Init(zero_quantized_weights=True)
    with pytest.raises(ImportError, match="^deepspeed.zero.register_external_parameter is not offered"):
        from zerokit.deepspeed.zero import register_external_parameter  # noqa: F401


def write_in_rank_dependent_orders(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """from_pretrained's two writes before initialize() (weight initialisation, then the checkpoint), each listing
    the parameters in an order that differs between ranks, as a list built from a set does; rank 0 writes a
    different value into each. Returns each parameter's value after each write, and after initialize()."""
    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it
    with deepspeed.zero.Init(config_dict_or_path=config(stage=3)):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(6, 6) for _ in range(4)))  # same shapes: a wrong pairing raises nothing
    names = {id(param): name for name, param in model.named_parameters()}
    layers = list(model) if rank == 0 else list(reversed(model))
    seen = {}
    for write, listed in enumerate(([p for layer in layers for p in layer.parameters()],
                                    [p for layer in reversed(layers) for p in layer.parameters()])):
        with deepspeed.zero.GatheredParameters(listed, modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    for index, (_, param) in enumerate(model.named_parameters()):
                        param.fill_(100 * write + index)
        seen[f"write {write}"] = {names[id(param)]: param.detach().clone() for param in model.parameters()}
    engine, *_ = deepspeed.initialize(model=model, config=config(stage=3, **BLOCKS))
    seen["initialized"] = engine.full_state_dict()
    engine.destroy()
    return seen


def test_from_pretrained_writes_pair_parameters_whatever_order_each_rank_lists_them() -> None:
    """See [Note: pairing written parameters across ranks] in zerokit/deepspeed/zero.py."""
    names = [name for name, _ in nn.Sequential(*(nn.Linear(6, 6) for _ in range(4))).named_parameters()]
    for rank, seen in enumerate(spawn(write_in_rank_dependent_orders, 2, timeout=300)):
        for write in (0, 1):
            for index, name in enumerate(names):
                assert torch.equal(seen[f"write {write}"][name], torch.full_like(seen[f"write {write}"][name],
                                                                                 100 * write + index)), (rank, name)
        for index, name in enumerate(names):
            assert torch.equal(seen["initialized"][name], seen["write 1"][name]), (rank, name)


def test_written_meta_parameters_zero_init_did_not_build_are_refused(one_process) -> None:
    with torch.device("meta"):
        model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"^GatheredParameters\(modifier_rank=...\) before initialize\(\) was given "
                                         r"2 meta parameters not built under deepspeed.zero.Init"):
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            pass
    with deepspeed.zero.Init(config_dict_or_path=config(stage=3)):
        built = nn.Linear(3, 3)
    with deepspeed.zero.GatheredParameters([*built.parameters(), model.weight], modifier_rank=0):  # one: put last
        pass
    assert not any(param.is_meta for param in built.parameters()) and not model.weight.is_meta


# --- comm, accelerator, refusals -----------------------------------------------------------------------------

def test_comm_is_torch_distributed_with_deepspeeds_names(one_process) -> None:
    ds_comm.init_distributed()
    tensor = torch.ones(3)
    ds_comm.all_reduce(tensor, op=ds_comm.ReduceOp.SUM, prof=True, log_name="x")
    ds_comm.barrier()
    assert (ds_comm.get_rank(), ds_comm.get_world_size(), ds_comm.get_local_rank()) == (0, 1, 0)
    assert tensor.tolist() == [1.0, 1.0, 1.0] and ds_comm.is_initialized()


def test_init_distributed_respects_dist_init_required(one_process) -> None:
    with pytest.raises(RuntimeError, match="^Distributed backend is not initialized"):
        deepspeed.init_distributed(dist_init_required=False)
    deepspeed.init_distributed(dist_init_required=True)
    assert dist.is_initialized() and dist.get_backend() == "gloo"


def test_the_accelerator_answers_for_the_cpu(one_process) -> None:
    accelerator = get_accelerator()
    assert (accelerator.device_name(), accelerator.current_device_name(), accelerator.current_device()) == \
        ("cpu", "cpu", 0)
    assert accelerator.is_available() and accelerator.device_count() == 1 and accelerator.memory_allocated() > 0
    assert accelerator.communication_backend_name() == "gloo" and accelerator.on_accelerator(torch.ones(1))
    accelerator.synchronize()
    accelerator.manual_seed(3)
    first = torch.rand(2)
    accelerator.manual_seed(3)
    assert torch.equal(first, torch.rand(2))
    with pytest.raises(AttributeError, match=r"^get_accelerator\(\).create_graph\(\) is not offered"):
        accelerator.create_graph()


@pytest.mark.parametrize("module", ["zerokit.deepspeed.launcher"])
def test_out_of_scope_modules_are_refused_naming_them(module: str) -> None:
    with pytest.raises(ImportError) as error:
        importlib.import_module(module)
    assert "not offered by zerokit" in str(error.value) and "\n" not in str(error.value)


def test_out_of_scope_calls_are_refused_naming_them(one_process) -> None:
    from zerokit.deepspeed import PipelineModule  # offered since issue 32: tests/test_deepspeed_pipe.py
    assert PipelineModule.__module__ == "zerokit.deepspeed.pipe"
    with pytest.raises(ImportError, match="^deepspeed.init_inference is not offered"):
        deepspeed.init_inference(small_model())
    with pytest.raises(ValueError, match="other model-parallel mpus are not offered by zerokit"):
        deepspeed.initialize(model=small_model(), config=config(**BLOCKS), mpu=object())
    with pytest.raises(ValueError, match="mesh_param="):
        deepspeed.initialize(model=small_model(), config=config(**BLOCKS), mesh_param=(2, 1))
    engine, *_ = deepspeed.initialize(model=small_model(), config=config(**BLOCKS))
    for call in (engine.offload_states, engine.reload_states):
        with pytest.raises(NotImplementedError, match=f"^engine.{call.__name__}\\(\\) is out of scope"):
            call()
    with pytest.raises(ValueError, match="retain_graph=True"):
        engine.backward(lm_loss(engine, TOKENS), retain_graph=True)


def test_deepspeed_ops_adam_are_torch_optimizers() -> None:
    from zerokit.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    params = [nn.Parameter(torch.zeros(2))]
    assert type(FusedAdam(params, lr=0.1)) is torch.optim.AdamW
    assert type(DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam
    assert FusedAdam(params).defaults["weight_decay"] == 0.0  # DeepSpeed's default, not torch AdamW's 0.01
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam(params, bias_correction=False)


def test_config_as_a_json_path(one_process, tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": "true"}, '
                    '"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}')
    engine, optimizer, _, scheduler = deepspeed.initialize(model=small_model(), config=str(path))
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.bfloat16_enabled() and scheduler is None
    assert isinstance(optimizer, torch.optim.SGD) and engine.zero_optimization_stage() == 0
