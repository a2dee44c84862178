"""The engine's decisions, made once (zerokit/config/settings.py), are the ones the planner predicts from: for a grid of
configs on 3 gloo ranks (a world size that divides no bucket), the settings the engine resolved equal the planner's
for the same setup, and the planner's bucket layout, bucket count and collectives per optimizer step equal what the
engine then built and sent (one spawn for the whole grid)."""

from __future__ import annotations

import functools
import itertools

import pytest

torch = pytest.importorskip("torch")

import zerokit  # noqa: E402
from zerokit.planner.engine_model import engine_buckets, engine_comm, engine_states  # noqa: E402
from zerokit.profiling.inventory import param_inventory  # noqa: E402
from zerokit.profiling.record import engine_setup  # noqa: E402
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

WORLD = 3


def _grid() -> list[dict]:
    """Stage x bucket size x reduce kind x (fp32 with accumulation, or bf16 reduced in bf16, whose 2-byte elements
    make more of them to a bucket), and stage 2's reduce_every_micro_step."""
    cases = []
    for stage, bucket, scatter, (accumulation, dtype) in itertools.product(
            (0, 1, 2, 3), (3000, 1 << 20), (None, True), ((1, "fp32"), (2, "fp32"), (1, "bf16"))):
        if stage == 0 and scatter:
            continue
        every = (True, False) if stage == 2 else (True,)
        for reduce_every in every:
            cases.append({"stage": stage, "reduce_bucket_bytes": bucket, "reduce_scatter": scatter,
                          "reduce_every_micro_step": reduce_every, "accumulation": accumulation, "dtype": dtype})
    return cases


CASES = _grid()


def _config(case: dict) -> dict:
    zero = {key: case[key] for key in ("stage", "reduce_bucket_bytes", "reduce_every_micro_step")}
    if case["reduce_scatter"] is not None:
        zero["reduce_scatter"] = case["reduce_scatter"]
    if case["stage"] == 3:
        zero.update(stage3_unit_classes=["Block"], sub_group_size=5000)
    bf16 = {"bf16": {"enabled": True}, "communication_data_type": "bf16"} if case["dtype"] == "bf16" else {}
    return {"zero_optimization": zero, "gradient_accumulation_steps": case["accumulation"], **bf16}


def _run(rank: int, case: dict) -> dict:
    torch.manual_seed(0)
    net = TinyGPT(TinyGPTConfig(with_test_features=False, n_layer=3))
    optimizer = torch.optim.AdamW(param_groups(net))
    engine = zerokit.initialize(net, optimizer, _config(case))
    generator = torch.Generator().manual_seed(rank)
    for step in range(2):  # the second optimizer step is measured: the optimizer's state exists by then
        before = engine.comm_stats()
        for _ in range(case["accumulation"]):
            tokens = torch.randint(0, 67, (2, 17), generator=generator)
            engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
            engine.step()
    after = engine.comm_stats()
    layout = [(b.numel, tuple(slot.numel for slot in b.slots)) for b in engine.stage.layout.buckets]
    out = {"settings": engine.settings, "layout": layout, "setup": engine_setup(engine, "adamw"),
           "inventory": param_inventory(net, optimizer, engine.config.stage3), "after_step": engine.memory_stats(),
           "comm": {k: {key: after[k][key] - before[k][key] for key in after[k]} for k in after
                    if after[k]["calls"] != before[k]["calls"]}}
    engine.close()
    return out


def _all(rank: int, world: int) -> list[dict]:
    return [_run(rank, case) for case in CASES]


@functools.lru_cache(maxsize=None)
def runs() -> list[dict]:
    return spawn(_all, WORLD, timeout=600)[0]


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=["stage{stage}-{reduce_bucket_bytes}B-rs{reduce_scatter}-every{reduce_every_micro_step}"
                              "-accum{accumulation}-{dtype}".format(**case) for case in CASES])
def test_the_planner_predicts_from_the_engines_own_settings(index: int) -> None:
    run = runs()[index]
    setup = run["setup"]
    assert setup.settings == run["settings"]  # one decision, not two that agree
    buckets = engine_buckets(run["inventory"], setup)
    assert [(b.numel, b.sizes) for b in buckets] == run["layout"]
    assert engine_states(run["inventory"], setup).after_step == run["after_step"]
    assert engine_comm(run["inventory"], setup) == run["comm"]


def test_the_grid_reaches_every_decision() -> None:
    """The grid makes each decision both ways: scatter and all-reduce, reducing every micro-step and at the
    boundary only, several buckets and one per group."""
    settings = [run["settings"] for run in runs()]
    assert {s.reduce_scatter for s in settings if s.stage > 0} == {True, False}
    assert {s.reduces_every_micro_step for s in settings if s.stage == 2} == {True, False}
    assert len({len(run["layout"]) for run in runs() if run["settings"].stage == 2}) > 1
