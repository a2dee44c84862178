"""What the engine holds is reachable: every stateful part saves and loads, the layout names each slot,
a reduction can chain collectives, and the start-up log says what was chosen. One plain process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerokit
from zerokit.comm import Communicator, Reduction
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups

CONFIGS = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16", "fp16")]


def make_engine(stage: int, dtype: str) -> tuple[zerokit.Engine, TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_bytes": 8192}, "gradient_clipping": 0.5}
    if stage == 3:
        config["zero_optimization"]["stage3_min_unit_params"] = 1000
    if dtype != "fp32":
        config[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    return zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2), config), model


def train_loss(engine: zerokit.Engine, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(step))
    return lm_loss(engine(tokens[:, :-1]), tokens)


def train(engine: zerokit.Engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = train_loss(engine, step)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage,dtype", CONFIGS, ids=[f"stage{s}-{d}" for s, d in CONFIGS])
def test_state_dict_resumes_exactly(one_process, stage: int, dtype: str) -> None:
    """Three steps, a state_dict, three more; a fresh engine that loads the state_dict takes the same last
    three steps bit for bit (masters, optimizer state, loss scale, counters)."""
    engine, _ = make_engine(stage, dtype)
    train(engine, range(3))
    state = engine.state_dict()
    state = {"stage": _clone(state["stage"]), "loss_scaler": dict(state["loss_scaler"]),
             "progress": dict(state["progress"])}
    expected = train(engine, range(3, 6))
    final = engine.full_state_dict()
    resumed, _ = make_engine(stage, dtype)
    resumed.load_state_dict(state)
    assert resumed.progress.optimizer_step == 3 and resumed.loss_scaler.scale == state["loss_scaler"]["scale"]
    assert train(resumed, range(3, 6)) == expected
    for name, value in resumed.full_state_dict().items():
        assert torch.equal(value, final[name]), name


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def test_layout_records_each_parameters_name_and_shape(one_process) -> None:
    engine, model = make_engine(2, "fp32")
    params = dict(model.named_parameters())  # lm_head.weight is tied to wte.weight: named once
    slots = [slot for bucket in engine.stage.layout.buckets for slot in bucket.slots]
    assert sorted(slot.name for slot in slots) == sorted(name for name, p in params.items() if p.requires_grad)
    assert all(slot.shape == tuple(params[slot.name].shape) for slot in slots)


def test_a_reduction_chains_collectives_in_order(one_process) -> None:
    """What hybrid sharding needs: a second collective started from the first one's result."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = Communicator()
    steps: list[str] = []
    tensor = torch.ones(4)

    def second(output: torch.Tensor) -> Reduction:
        steps.append("first done")
        return Reduction(comm.all_reduce(output.mul_(3), async_op=True), lambda out: steps.append(f"{out.sum():g}"))

    Reduction(comm.all_reduce(tensor, async_op=True), second).complete()
    assert steps == ["first done", "12"] and comm.stats.as_dict()["all_reduce"]["calls"] == 2


def test_start_up_log_names_the_stage_buckets_and_units(one_process, capsys) -> None:
    make_engine(3, "bf16")
    log = capsys.readouterr().err
    assert "[zerokit rank 0] ZeRO stage 3 (ShardedParameters) on 1 rank(s), gloo" in log
    assert "all-reduced, this rank keeping its shard" in log  # gloo's reduction path
    assert "stage 3: 3 units (2 besides the root)" in log


def test_plan_report_asks_for_a_recorded_run_first(one_process) -> None:
    """engine.plan_report() is zerokit.profiling.report.plan_report for this engine (tested on a recorded run in
    tests/planner/test_planner_engine_exact.py); without a recorded run it says what to call."""
    engine, _ = make_engine(1, "fp32")
    with pytest.raises(ValueError, match=r"no run recorded for this engine; call zerokit.profiling.record_run"):
        engine.plan_report()


def test_a_waited_collective_holds_none_of_its_tensors(one_process) -> None:
    """What the deadline watcher keeps of a collective (its TrackedWork) must not keep the collective's tensors
    once it was waited on: they are freed as soon as zerokit lets go of them (See [Note: a waited collective lets
    go of its tensors] in zerokit/comm/deadline.py)."""
    import gc
    import time
    import weakref

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = Communicator.create(timeout_seconds=60.0)
    tensor = torch.ones(1024)
    gone = weakref.ref(tensor)
    pending = comm.all_reduce(tensor, async_op=True)
    kept = pending.work  # as the watcher keeps it
    pending.work.wait()
    del tensor, pending
    # gloo's worker thread lets go of a Work it completed a moment after wait() returns (See [Note: leaving at exit]
    # in zerokit/comm/process.py): on a busy machine that moment is seen, so the tensor is given a few seconds to go
    give_up = time.monotonic() + 5.0
    while (gc.collect(), gone())[1] is not None and time.monotonic() < give_up:
        time.sleep(0.01)
    assert gone() is None and kept.is_completed()
    comm.close()
