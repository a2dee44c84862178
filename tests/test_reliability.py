"""Issue 13: ranks that disagree, stall or diverge raise a clear error naming the cause, in bounded time.

Every case runs on real gloo ranks with a short comm_timeout_seconds, and every spawn has a timeout, so a
rank that hangs fails its test instead of the whole run. One spawn serves many cases."""

from __future__ import annotations

import functools
import json
import os
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerokit
from zerokit.comm import CollectiveError
from zerokit.config.typed import load_config
from zerokit.stages.agreement import SkippedUnitError
from zerokit.reliability.fingerprint import RanksDisagreeError
from zerokit.testing.models import Block, TinyGPT, TinyGPTConfig, lm_loss, param_groups, rank_batch, small_zero_config
from zerokit.testing.spawn import spawn

STALL_TIMEOUT = 1.5  # comm_timeout_seconds where a rank stalls
# What a waiting rank may take beyond the timeout: it waits 1 s for the other ranks' reports (See report_grace in
# zerokit/comm/deadline.py), then writes its flight recorder; the rest is two ranks sharing two busy cores.
MARGIN = 3.0
SPAWN_TIMEOUT = 240  # seconds: a spawn still running after this is killed and fails


def tiny(n_layer: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(n_layer=n_layer))


# --- agreement at start ----------------------------------------------------------------------------------
# (case, stage, the field every rank must name). The last rank changes one thing; the others do not.
DISAGREEMENTS = [
    ("stage", 2, "config.stage"),
    ("architecture", 0, "parameter blocks.2.ln_1.weight"),
    ("architecture", 2, "parameter blocks.2.ln_1.weight"),
    ("architecture", 3, "parameter blocks.2.ln_1.weight"),
    ("accumulation", 2, "config.gradient_accumulation_steps"),
    ("precision", 1, "config.precision.param_dtype"),
    ("unit policy", 3, "config.stage3.unit_classes"),
    ("learning rate", 2, "optimizer 0 group 0 lr"),  # issue 15: optimizer hyperparameters are covered too
    ("clipping", 0, "config.gradient_clipping"),
]


def _disagreeing_setup(case: str, stage: int, odd: bool) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    model = tiny(3 if case == "architecture" and odd else 2)
    optimizer = torch.optim.AdamW(param_groups(model), lr=2e-3 if case == "learning rate" and odd else 1e-3)
    settings = small_zero_config(3 if case == "stage" and odd else stage)
    if odd and case == "accumulation":
        settings["gradient_accumulation_steps"] = 2
    if odd and case == "precision":
        settings["bf16"] = {"enabled": True}
    if odd and case == "unit policy":
        settings["zero_optimization"]["stage3_unit_classes"] = ["Block"]
    if odd and case == "clipping":
        settings["gradient_clipping"] = 1.0
    return model, optimizer, settings


def _disagreements(rank: int, world_size: int) -> list[dict]:
    outcomes = []
    for case, stage, _ in DISAGREEMENTS:
        model, optimizer, settings = _disagreeing_setup(case, stage, odd=rank == world_size - 1)
        started = time.time()
        try:
            zerokit.initialize(model, optimizer, settings)
            outcomes.append({"error": None})
        except RanksDisagreeError as error:
            outcomes.append({"error": str(error), "seconds": time.time() - started})
    return outcomes


@functools.lru_cache(maxsize=None)
def disagreements(world_size: int) -> list[list[dict]]:
    return spawn(_disagreements, world_size, timeout=SPAWN_TIMEOUT)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("index", range(len(DISAGREEMENTS)), ids=[f"{c}-stage{s}" for c, s, _ in DISAGREEMENTS])
def test_ranks_that_disagree_are_named_at_initialize(world_size: int, index: int) -> None:
    _, _, field = DISAGREEMENTS[index]
    outcomes = [ranks[index] for ranks in disagreements(world_size)]
    messages = {outcome["error"] for outcome in outcomes}
    assert len(messages) == 1 and None not in messages  # every rank raised, with the same line
    message = messages.pop()
    same = "rank 0" if world_size == 2 else "ranks 0, 1"
    assert message.startswith(f"zerokit.initialize: the ranks disagree on {field}: {same}: "), message
    assert f"; rank {world_size - 1}: " in message and "\n" not in message
    assert all(outcome["seconds"] < 10 for outcome in outcomes)  # within seconds, not at a timeout


def test_the_first_difference_names_the_values_each_rank_holds() -> None:
    message = disagreements(2)[0][0]["error"]
    assert "the ranks disagree on config.stage: rank 0: '2'; rank 1: '3' (" in message


# --- a rank that stalls ----------------------------------------------------------------------------------
def _stall(rank: int, world_size: int, flight_dir: str) -> list[dict]:
    """At every stage: one good step, then rank 1 stops calling collectives for a while inside a step (after its
    forward, before its backward). At stage 3 it then goes on, and must raise too."""
    os.environ["ZEROKIT_FLIGHT_DIR"] = flight_dir
    outcomes = []
    for stage in (0, 1, 2, 3):
        model = tiny()
        engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-3),
                                    small_zero_config(stage, comm_timeout_seconds=STALL_TIMEOUT))
        tokens = rank_batch(rank, 0)
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        outcome: dict = {"stage": stage, "error": None}
        raised = Path(flight_dir) / f"rank0-raised-at-stage{stage}"
        if rank == 1:
            _alive_outside_collectives_until(raised)
        if rank == 0 or stage == 3:
            started = time.time()
            try:
                engine.backward(loss)
                engine.step()
            except CollectiveError as error:
                outcome.update(error=str(error), seconds=time.time() - started)
            if rank == 0:
                raised.touch()
        dist.barrier()  # the job's own group: start the next stage together
        outcomes.append(outcome)
    return outcomes


def _alive_outside_collectives_until(raised: Path) -> None:
    """Rank 1's stall: alive, in no collective, until rank 0 has raised (it writes `raised`), so the test waits for
    the event rather than for a sleep long enough on a busy machine. A rank 0 that never raises still releases it,
    after far longer than rank 0 may take (the test then fails on rank 0's outcome)."""
    give_up = time.monotonic() + 10 * (STALL_TIMEOUT + MARGIN)
    while not raised.exists() and time.monotonic() < give_up:
        time.sleep(0.01)


@functools.lru_cache(maxsize=None)
def stalls(flight_dir: str) -> list[list[dict]]:
    return spawn(_stall, 2, flight_dir, timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def flight_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("flight"))


NAMED = re.compile(r"rank 0: (all_reduce|all_gather|broadcast|reduce_scatter|reduce) #\d+ on the "
                   r"(shard|gather|control) group \((?P<purpose>[^)]+)\)")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_stalled_rank_makes_the_others_raise_within_the_timeout(flight_dir: str, stage: int) -> None:
    outcome = stalls(flight_dir)[0][stage]
    message = outcome["error"]
    assert message is not None, "rank 0 did not notice that rank 1 stalled"
    assert outcome["seconds"] < STALL_TIMEOUT + MARGIN
    match = NAMED.search(message)
    assert match and f"did not complete within comm_timeout_seconds={STALL_TIMEOUT:g}" in message, message
    assert "gradients" in match["purpose"] or "unit" in match["purpose"]  # what it was for
    assert "last collectives rank 0 completed (oldest first):" in message
    assert re.search(r"rank 1: no report within [\d.]+ s: stalled outside zerokit's collectives", message)
    # the flight recorder: the file the message names, with the collective that timed out as its last word
    path = Path(re.search(r"flight recorder of rank 0 \(its last \d+ collectives\): (\S+)", message)[1])
    assert path.parent == Path(flight_dir)
    recorded = json.loads(path.read_text())
    failed = [entry for entry in recorded["collectives"] if entry["error"] is not None]
    assert recorded["rank"] == 0 and len(failed) == 1 and failed[0]["error"] == "timed out"
    assert f"{failed[0]['kind']} #{failed[0]['sequence']} on the {failed[0]['group']} group" in message


def test_the_stalled_rank_raises_too_when_it_comes_back(flight_dir: str) -> None:
    message = stalls(flight_dir)[1][3]["error"]
    assert message is not None and re.search(r"rank 1: \w+ #\d+ on the \w+ group", message), message


# --- stage 3: a unit skipped on some ranks ----------------------------------------------------------------
class Skippy(nn.Module):
    """Three blocks, each a stage-3 unit; the first token of a batch names a block this batch skips (3: none),
    so ranks with different data run different blocks: data-dependent control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(67, 24)
        self.blocks = nn.ModuleList(Block(TinyGPTConfig()) for _ in range(3))
        self.head = nn.Linear(24, 67)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for index, block in enumerate(self.blocks):
            if index != int(idx[0, 0]):
                x = block(x)
        return self.head(x)


class UnevenSkippy(Skippy):
    """Skippy with blocks of three sizes: ranks that part gather different sizes, which must never pair."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(24, hidden), nn.ReLU(), nn.Linear(hidden, 24))
                                    for hidden in (64, 96, 128))


class SideHead(Skippy):
    """Skippy whose side block runs in every forward on every rank; a first token of 4 adds its output to the
    loss (times zero), and only then does backward gather it: the backward's order changes, the forward's not."""

    def __init__(self) -> None:
        super().__init__()
        self.side = Block(TinyGPTConfig())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        side, logits = self.side(x), self.head(x)
        return logits + 0 * side.mean() if int(idx[0, 0]) == 4 else logits


SKIPS = [(3, 3), (3, 1), (2, 0)]  # per step: the block rank 0 and rank 1 skip
SKIPS_ALIKE = [(3, 3), (1, 1), (1, 1), (1, 1), (3, 3)]  # every rank skips blocks.1 on three steps, then runs it
SIDE_ON_ONE, SIDE_ON_ALL = [(3, 3), (3, 4)], [(3, 3), (4, 4)]  # SideHead's side output in rank 1's loss, in all


def skippy_batch(rank: int, step: int, skips: list[tuple[int, int]] = SKIPS) -> torch.Tensor:
    tokens = rank_batch(rank, step)
    tokens[0, 0] = skips[step][rank]
    return tokens


def skippy_engine(mode: str, model_class: type[Skippy] = Skippy) -> tuple[Skippy, zerokit.Engine]:
    torch.manual_seed(0)
    model = model_class()
    settings = load_config(small_zero_config(3))
    settings = replace(settings, stage3=replace(settings.stage3, skipped_units=mode))
    return model, zerokit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), settings)


def skippy_step(engine: zerokit.Engine, rank: int, step: int, skips: list[tuple[int, int]] = SKIPS) -> None:
    tokens = skippy_batch(rank, step, skips)
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
    engine.step()


def raised_at(engine: zerokit.Engine, rank: int, skips: list[tuple[int, int]]) -> tuple[int, str] | None:
    """Train the steps of `skips` until one raises SkippedUnitError: (that step, the message)."""
    for step in range(len(skips)):
        try:
            skippy_step(engine, rank, step, skips)
        except SkippedUnitError as error:
            return step, str(error)
    return None


def _skipped(rank: int, world_size: int) -> dict:
    outcome = {}
    # "raise" in training: the first step agrees; on the second rank 1 skips blocks.1 (with blocks of equal
    # sizes, and of different sizes)
    for key, model_class in (("train", Skippy), ("uneven", UnevenSkippy)):
        outcome[key] = raised_at(skippy_engine("raise", model_class)[1], rank, SKIPS[:2])
    # "raise" when every rank leaves the last step's order alike (blocks.1 skipped by all, then run by all again):
    # no error, the same training as one process, and one table per forward and backward once an order is followed
    model, engine = skippy_engine("raise")
    agreement, rounds = engine.stage.shards.agreement, []
    for step in range(len(SKIPS_ALIKE)):
        before = agreement.rounds
        skippy_step(engine, rank, step, SKIPS_ALIKE)
        rounds.append(agreement.rounds - before)
    outcome["alike"] = {"params": engine.full_state_dict(), "rounds": rounds, "served": agreement.served}
    # "raise" when backward asks for a unit the last backward did not gather (on one rank; on every rank)
    for key, skips in (("side on one", SIDE_ON_ONE), ("side on all", SIDE_ON_ALL)):
        outcome[key] = raised_at(skippy_engine("raise", SideHead)[1], rank, skips)
    # "raise" in a no_grad eval (issue 15: this gave one silently wrong output, then an abort)
    model, engine = skippy_engine("raise")
    try:
        with torch.no_grad():
            engine(skippy_batch(rank, 1)[:, :-1])
    except SkippedUnitError as error:
        outcome["eval"] = str(error)
    # "gather": trains what each rank's control flow asks for; then a no_grad eval with a skip on one rank
    for model_class in (Skippy, UnevenSkippy):
        model, engine = skippy_engine("gather", model_class)
        for step in range(len(SKIPS)):
            skippy_step(engine, rank, step)
        with torch.no_grad():
            output = engine(skippy_batch(rank, 1)[:, :-1])
        outcome[model_class.__name__] = {"output": output, "served": engine.stage.shards.agreement.served,
                                         "params": engine.full_state_dict()}
    return outcome


@functools.lru_cache(maxsize=None)
def skipped() -> list[dict]:
    return spawn(_skipped, 2, timeout=SPAWN_TIMEOUT)


def test_a_unit_skipped_on_one_rank_is_named_at_the_first_divergent_gather() -> None:
    """On the second step rank 1 skips blocks.1. Both ranks prefetched it in forward (last step's order), so the
    forward computed right on both, and the first gather where they part is backward's prefetch."""
    messages = {outcome["train"] for outcome in skipped()}
    assert len(messages) == 1  # every rank raised, at the same gather, with the same words
    step, message = messages.pop()
    assert step == 1
    # the second step follows the first one's order without rows: rank 1 served blocks.1's gather for rank 0
    assert message.startswith("stage 3: the ranks asked for different units at the same gather (backward gather #2 "
                              "of the order the ranks last agreed on): ")
    assert ("rank 0: unit 'blocks.1' (backward prefetch, micro-step 1); "
            "rank 1: unit 'blocks.0' (backward prefetch, micro-step 1). ") in message


def _skipped_on_three(rank: int, world_size: int) -> tuple[int, str] | None:
    return raised_at(skippy_engine("raise", UnevenSkippy)[1], rank, [(3, 3, 3), (3, 1, 3)])


def test_a_unit_skipped_on_one_of_three_ranks_is_named_on_all_three() -> None:
    """Three ranks (a world size that divides nothing here): rank 1 alone skips blocks.1 of units of three sizes."""
    outcomes = set(spawn(_skipped_on_three, 3, timeout=SPAWN_TIMEOUT))
    assert len(outcomes) == 1
    step, message = outcomes.pop()
    assert step == 1 and ("rank 0: unit 'blocks.1' (backward prefetch, micro-step 1); rank 1: unit 'blocks.0' "
                          "(backward prefetch, micro-step 1); rank 2: unit 'blocks.1' (backward prefetch, "
                          "micro-step 1). ") in message, message


def test_units_of_different_sizes_are_named_before_their_gathers_pair() -> None:
    """Gathers of different sizes that pair abort gloo (SIGABRT): the rows are checked before the gathers start."""
    messages = {outcome["uneven"] for outcome in skipped()}
    assert len(messages) == 1
    step, message = messages.pop()
    assert step == 1
    assert ("rank 0: unit 'blocks.1' (backward prefetch, micro-step 1); "
            "rank 1: unit 'blocks.0' (backward prefetch, micro-step 1). ") in message


def test_a_unit_skipped_on_one_rank_in_a_no_grad_eval_raises_instead_of_a_wrong_output() -> None:
    for outcome in skipped():
        assert ("rank 0: unit 'blocks.1' (forward, micro-step 0); rank 1: unit 'blocks.2' (forward, micro-step 0)"
                in outcome["eval"])


def test_ranks_that_leave_the_last_order_alike_train_as_one_process_does() -> None:
    """Every rank skips blocks.1 on steps 1-3 and runs it again on step 4. Step 1's backward serves the gather the
    order promised; step 2's forward too (its prefetches follow step 1's pre-forward order, step 1's followed step
    0's); step 4's forward finds blocks.1 outside the order's rest (rows from there on). None is an error."""
    reference = reference_skippy(Skippy, SKIPS_ALIKE)
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    for outcome in skipped():
        torch.testing.assert_close(outcome["alike"]["params"], expected, rtol=1e-5, atol=1e-6)
        rounds = outcome["alike"]["rounds"]
        # one table per forward and one per backward on the steps that follow both orders (1 and 3); a row per
        # unit gather where none is followed (step 0; the backwards of steps 2 and 4, whose forwards left theirs)
        assert rounds[1] == rounds[3] == 2 and min(rounds[0], rounds[2], rounds[4]) > 2, rounds
        assert outcome["alike"]["served"] > 0


def test_a_backward_that_needs_a_unit_outside_the_last_order_is_named_not_left_to_a_timeout() -> None:
    """Rank 1's backward needs the side block, which the last backward never gathered: it releases its gradient
    reductions (rank 0 may be waiting for one), issues the gathers rank 0 issues, and both raise by name."""
    messages = {outcome["side on one"] for outcome in skipped()}
    assert len(messages) == 1
    step, message = messages.pop()
    assert step == 1 and "(backward gather #2 of the order the ranks last agreed on): " in message, message
    assert ("rank 0: unit 'blocks.2' (backward, micro-step 1); rank 1: unit 'side.mlp.0' (backward prefetch, "
            "micro-step 1). ") in message


def test_a_backward_order_that_changes_on_every_rank_alike_names_the_gather_mode() -> None:
    messages = {outcome["side on all"] for outcome in skipped()}
    assert len(messages) == 1
    step, message = messages.pop()
    assert step == 1 and message.startswith("stage 3: every rank's backward (micro-step 1) asked for unit "
                                            "'side.mlp.0' at gather #2, which the last backward did not gather"), message
    assert 'Stage3Policy(skipped_units="gather")' in message


def reference_skippy(model_class: type[Skippy], skips: list[tuple[int, int]] = SKIPS) -> Skippy:
    """One process trains on the union of both ranks' batches (the mean of their losses), as the ranks do."""
    torch.manual_seed(0)
    model = model_class()
    # SGD: Adam would turn the rounding noise of gradients that are zero in exact arithmetic (attention's key
    # bias) into lr-sized steps, which no tolerance can tell from a bug
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(len(skips)):
        for rank in range(2):
            tokens = skippy_batch(rank, step, skips)
            (lm_loss(model(tokens[:, :-1]), tokens) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("model_class", [Skippy, UnevenSkippy])  # blocks of equal sizes, and of three sizes
def test_skipped_units_gathered_by_every_rank_train_as_one_process_does(model_class: type[Skippy]) -> None:
    reference = reference_skippy(model_class)
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    outcomes = [outcome[model_class.__name__] for outcome in skipped()]
    for rank, outcome in enumerate(outcomes):
        torch.testing.assert_close(outcome["params"], expected, rtol=1e-5, atol=1e-6)
        with torch.no_grad():  # and the no_grad eval with a unit skipped on one rank is exact too
            torch.testing.assert_close(outcome["output"], reference(skippy_batch(rank, 1)[:, :-1]), rtol=1e-5,
                                       atol=1e-6)
    assert all(outcome["served"] > 0 for outcome in outcomes)  # each rank gathered units only the other used
