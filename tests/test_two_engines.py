"""Two engines in one process share nothing (issue 24): an RLHF trainer's actor and critic, a student and a teacher.

On 3 gloo ranks, engine A (stage 3, every unit checkpointed, profiled) and engine B (stage 1, no checkpointing,
built after A) train interleaved micro-step by micro-step: A's forward, B's forward, A's backward, B's backward,
A's step, B's step. Each equals its own one-process reference (fp32 tolerances of tests/test_parity.py: losses
rtol 1e-5, parameters atol 2e-5), each counts exactly the collectives and bytes it counts when it trains alone
in a process, and A keeps its own activation-checkpointing settings after B is built (before each engine had its
own checkpointer, B's block replaced A's for the whole process, and A's profile lines stopped).
"""

from __future__ import annotations

import logging

import pytest
import torch

from zerokit.testing.parity import Case, engine_config, forward_loss, make_batch, make_model, make_optimizer, \
    run_reference
from zerokit.testing.spawn import spawn

WORLD_SIZE = 3
ACTOR = Case("actor", stage=3, checkpoint_units=True, steps=3)
CRITIC = Case("critic", stage=1, steps=3)


def _config(case: Case) -> dict:
    config = engine_config(case)
    if case.checkpoint_units:
        config["activation_checkpointing"]["profile"] = True  # one log line per checkpointed forward
    return config


def _engine(case: Case):
    import zerokit

    model = make_model(case)
    return zerokit.initialize(model, make_optimizer(case, model), _config(case))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(rank: int, engines: list, cases: list[Case]) -> list[dict]:
    """Every engine steps through its case's batches, interleaved phase by phase; what each did."""
    profiled = _Lines()
    logging.getLogger("zerokit").addHandler(profiled)
    losses: list[list[float]] = [[] for _ in engines]
    checkpointed: list[int] = [0 for _ in engines]
    try:
        for step in range(cases[0].steps):
            outputs = []
            for index, (engine, case) in enumerate(zip(engines, cases)):
                before = len(profiled.lines)
                outputs.append(forward_loss(engine, make_batch(case, step, 0, rank)))
                checkpointed[index] += sum("checkpointed" in line for line in profiled.lines[before:])
            for engine, loss in zip(engines, outputs):
                engine.backward(loss)
            for engine, loss, seen in zip(engines, outputs, losses):
                engine.step()
                seen.append(loss.item())
    finally:
        logging.getLogger("zerokit").removeHandler(profiled)
    return [{"losses": seen, "checkpointed": count, "comm": engine.comm_stats(), "memory": engine.memory_stats(),
             "params": {k: v.float() for k, v in engine.full_state_dict().items()}}
            for engine, seen, count in zip(engines, losses, checkpointed)]


def _together_and_alone(rank: int, world_size: int) -> dict:
    import zerokit.comm.process

    zerokit.comm.process.logger.setLevel(logging.INFO)
    cases = [ACTOR, CRITIC]
    together = _train(rank, [_engine(case) for case in cases], cases)
    alone = [_train(rank, [_engine(case)], [case])[0] for case in cases]
    return {"together": together, "alone": alone}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn(_together_and_alone, WORLD_SIZE, timeout=300)


@pytest.mark.parametrize("index,case", [(0, ACTOR), (1, CRITIC)], ids=["actor-stage3", "critic-stage1"])
def test_each_engine_trains_as_one_process_does(runs: list[dict], index: int, case: Case) -> None:
    reference = run_reference(case, WORLD_SIZE)
    for rank, out in enumerate(runs):
        got = out["together"][index]
        expected = [loss for step, r, loss in reference["losses"] if r == rank]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        for name, value in reference["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=2e-5, msg=name)


@pytest.mark.parametrize("index", [0, 1], ids=["actor-stage3", "critic-stage1"])
def test_each_engine_counts_only_its_own_traffic_and_memory(runs: list[dict], index: int) -> None:
    for out in runs:
        together, alone = out["together"][index], out["alone"][index]
        assert together["comm"] == alone["comm"]
        assert together["memory"] == alone["memory"]


def test_each_engine_keeps_its_own_activation_checkpointing(runs: list[dict]) -> None:
    """A's units (2 blocks) are checkpointed with A's profile setting on every step, B built after A or not."""
    for out in runs:
        actor, critic = out["together"]
        assert actor["checkpointed"] == out["alone"][0]["checkpointed"] == 2 * ACTOR.steps
        assert critic["checkpointed"] == 0
