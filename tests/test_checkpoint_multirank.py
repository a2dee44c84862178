"""Sharded checkpoints on real gloo ranks (issue 11): save and resume at every stage, precision and world
size 1-3 (exact to the bit: the continuation adds in the same order as the run that never stopped), and
the reshard matrix: saved on N ranks at one stage, resumed on M ranks at another, N, M in {1, 2, 3}, with
stage pairs that cross 0-2 and 3. A resharded run adds its gradients over another number of ranks, so its
reference is the uninterrupted single-process run that sees N ranks' batches per step before the save and
M ranks' after it (`reference_run`), held to tests/test_parity.py's tolerances.

Spawns are shared: one per world size saves every checkpoint that world size is the source of and runs
every exact-resume case; one per world size then loads every checkpoint destined for it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zerokit
from test_parity import allowed_update_error, update_error
from zerokit.checkpoint import checkpoint_directory, consolidate, read_manifest
from zerokit.config.typed import DTYPES_BY_NAME
from zerokit.testing.parity import (Case, engine_config, forward_loss, fp32_state, make_batch, make_model,
                                    make_optimizer, run_reference)
from zerokit.testing.spawn import spawn

WORLD_SIZES = (1, 2, 3)
SAVED_AFTER, THEN = 2, 2  # optimizer steps before the save, and after it


@dataclass(frozen=True)
class Reshard:
    case: Case  # its stage is the saving stage
    source: int  # world size that saves
    target: int  # world size that loads
    target_stage: int
    saved_after: int = SAVED_AFTER

    @property
    def name(self) -> str:
        return f"{self.case.name}-N{self.source}s{self.case.stage}-to-M{self.target}s{self.target_stage}"


def resume_cases(world_size: int) -> list[Case]:
    """Exact resume: every stage x {fp32, bf16} at every world size, and, each at the world size where it
    means most (whole-tensor owners and uneven shards need several ranks), what must survive a save: fp16
    loss scaling that has skipped steps and changed its scale, frozen parameters (whole at stages 0-2,
    sharded at stage 3), whole-tensor optimizers, accumulation, pieces cut by sub_group_size."""
    cases = [Case(f"s{s}-{d}", stage=s, dtype=d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")]
    extras = [
        (Case("s1-fp16-overflowing", stage=1, dtype="fp16", initial_scale_power=19, steps=5), 2),
        (Case("s3-fp16-overflowing", stage=3, dtype="fp16", initial_scale_power=19, steps=5), 3),
        (Case("s2-frozen-block", stage=2, frozen_blocks=(1,)), 3),
        (Case("s3-bf16-norms-only-finetune", stage=3, dtype="bf16", freeze_matrices=True, min_unit_params=100), 2),
        (Case("s1-muon-adamw", stage=1, optimizer="muon+adamw", usage="idle-or-rank0"), 3),
        (Case("s3-muon-adamw", stage=3, optimizer="muon+adamw"), 2),
        (Case("s2-adafactor", stage=2, optimizer="adafactor", usage="idle-or-rank0"), 3),
        (Case("s3-bf16-sgd-momentum", stage=3, dtype="bf16", optimizer="sgd"), 1),
        (Case("s2-accum2", stage=2, accumulation=2), 2),
        (Case("s0-sub-groups", stage=0, bucket_bytes=2**20, sub_group_size=997), 1),
    ]
    if "offload_optimizer" in Case.__dataclass_fields__:  # offload tiers, once they exist
        extras += [(Case(f"s{s}-offload-cpu", stage=s, offload_optimizer="cpu"), 2) for s in (1, 3)]
    return cases + [case for case, n in extras if n == world_size]


NEVER_STEPPED = {"usage": "idle-or-rank0"}  # TinyGPT's `sometimes` layer: no rank runs it on step 0


def reshard_cases() -> list[Reshard]:
    """Every (N, M) pair with a stage pair that crosses 0-2 and 3 (every such pair of stages comes up), and
    the hard cases spread over the pairs: bf16, fp16, whole-tensor optimizers, frozen parameters, a
    parameter never stepped when saved (no optimizer state)."""
    pairs = [(3, 1), (0, 3), (1, 3), (3, 0), (2, 3), (3, 2)]
    cases = [Reshard(Case(f"fp32-{i}", stage=pairs[i % len(pairs)][0]), source, target, pairs[i % len(pairs)][1])
             for i, (source, target) in enumerate((n, m) for n in WORLD_SIZES for m in WORLD_SIZES)]
    cases += [
        Reshard(Case("bf16", stage=3, dtype="bf16"), 3, 2, 1),  # the example: 3 ranks at stage 3 -> 2 at 1
        Reshard(Case("bf16", stage=3, dtype="bf16"), 3, 1, 0),  # ... -> one plain process
        Reshard(Case("bf16", stage=1, dtype="bf16"), 2, 3, 3),
        Reshard(Case("fp16", stage=2, dtype="fp16", initial_scale_power=19, steps=5), 2, 1, 3, saved_after=3),
        Reshard(Case("muon-adamw", stage=1, optimizer="muon+adamw"), 3, 2, 3),
        Reshard(Case("muon-adamw", stage=3, optimizer="muon+adamw", dtype="bf16"), 2, 3, 0),
        Reshard(Case("adafactor", stage=3, optimizer="adafactor"), 3, 2, 2),
        Reshard(Case("frozen-norms", stage=3, freeze_norms=True), 3, 2, 1),
        Reshard(Case("frozen-block", stage=1, frozen_blocks=(0,)), 2, 3, 3),
        Reshard(Case("never-stepped", stage=3, **NEVER_STEPPED), 3, 1, 2, saved_after=1),
        Reshard(Case("never-stepped-sgd", stage=2, optimizer="sgd", clip=0.0, **NEVER_STEPPED), 2, 3, 3,
                saved_after=1),
    ]
    return cases


# Checkpoints consolidated offline (test_consolidated_*): (case, the world size that saves it).
CONSOLIDATE = [
    (Case("consolidate-fp32", stage=3, freeze_norms=True), 3),
    (Case("consolidate-bf16", stage=2, dtype="bf16"), 2),
    (Case("consolidate-hf-gpt2", stage=3, model="hf-gpt2", min_unit_params=100), 2),
]


# --- what the ranks run ----------------------------------------------------------------------------

def build(case: Case) -> zerokit.Engine:
    model = make_model(case)
    return zerokit.initialize(model, make_optimizer(case, model), engine_config(case))


def train(engine: zerokit.Engine, case: Case, steps: range, rank: int) -> tuple[list[float], list[bool]]:
    losses, skipped = [], []
    for step in steps:
        for micro in range(case.accumulation):
            loss = forward_loss(engine, make_batch(case, step, micro, rank))
            engine.backward(loss)
            result = engine.step()
            losses.append(loss.item())
        skipped.append(result.skipped)
    return losses, skipped


def trained_params(engine: zerokit.Engine) -> dict[str, torch.Tensor]:
    names = {name for name, _ in engine.module.named_parameters()}
    return {name: value for name, value in engine.full_state_dict().items() if name in names}


def resume_one(rank: int, case: Case, directory: Path) -> dict:
    """Train, save, go on; a fresh engine loads the save and goes on the same way: both continuations."""
    engine = build(case)
    train(engine, case, range(SAVED_AFTER), rank)
    engine.save_checkpoint(directory, client_state={"rank0_step": SAVED_AFTER, "case": case.name})
    after_save = torch.rand(3)  # the generators' next draws
    uninterrupted = train(engine, case, range(SAVED_AFTER, case.steps), rank)
    resumed = build(case)
    _, client_state = resumed.load_checkpoint(directory)
    after_load = torch.rand(3)
    continued = train(resumed, case, range(SAVED_AFTER, case.steps), rank)
    return {"uninterrupted": uninterrupted, "resumed": continued, "client_state": client_state,
            "rng": torch.equal(after_save, after_load), "params": trained_params(engine),
            "resumed_params": trained_params(resumed), "scale": (engine.loss_scaler.scale, resumed.loss_scaler.scale),
            "progress": (engine.progress, resumed.progress)}


def save_phase(rank: int, world_size: int, root: str) -> dict:
    out = {"resume": {case.name: resume_one(rank, case, Path(root) / f"resume-N{world_size}-{case.name}")
                      for case in resume_cases(world_size)}}
    for plan in reshard_cases():
        if plan.source == world_size:
            engine = build(plan.case)
            train(engine, plan.case, range(plan.saved_after), rank)
            engine.save_checkpoint(Path(root) / plan.name)
    for case, source in CONSOLIDATE:
        if source == world_size:
            engine = build(case)
            train(engine, case, range(SAVED_AFTER), rank)
            engine.save_checkpoint(Path(root) / case.name)
    return out


def load_phase(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for plan in reshard_cases():
        if plan.target == world_size:
            case = replace(plan.case, stage=plan.target_stage)
            engine = build(case)
            engine.load_checkpoint(Path(root) / plan.name)
            losses, skipped = train(engine, case, range(plan.saved_after, case.steps), rank)
            out[plan.name] = {"losses": losses, "skipped": skipped, "params": trained_params(engine)}
    return out


# --- the reference -----------------------------------------------------------------------------------

def reference_run(case: Case, ranks_per_step: list[int]) -> dict:
    """zerokit.testing.parity's single-process reference (See [Note: what the single-process reference
    computes] there), with the number of ranks whose batches make each step given per step."""
    return run_reference(case, ranks_per_step[0], ranks_per_step)


# --- fixtures and tests ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    saved = {n: spawn(save_phase, n, root) for n in WORLD_SIZES}
    loaded = {m: spawn(load_phase, m, root) for m in WORLD_SIZES}
    return saved, loaded, Path(root)


RESUME = [(n, case) for n in WORLD_SIZES for case in resume_cases(n)]


@pytest.mark.parametrize("world_size,case", RESUME, ids=[f"N{n}-{c.name}" for n, c in RESUME])
def test_resume_is_exact(runs, world_size: int, case: Case) -> None:
    """The resumed continuation equals the uninterrupted one to the bit: losses, skips, parameters, loss
    scale, counters, each rank's random generators; client_state comes back."""
    for rank, out in enumerate(runs[0][world_size]):
        result = out["resume"][case.name]
        assert result["resumed"] == result["uninterrupted"], f"rank {rank}"
        for name, value in result["params"].items():
            assert torch.equal(result["resumed_params"][name], value), f"rank {rank}: {name}"
        assert result["rng"] and result["scale"][0] == result["scale"][1]
        assert result["progress"][0] == result["progress"][1]
        assert result["client_state"] == {"rank0_step": SAVED_AFTER, "case": case.name}
    if case.dtype == "fp16":  # the scale changed before the save: skipped steps, then recovered
        skips = runs[0][world_size][0]["resume"][case.name]["uninterrupted"][1]
        assert runs[0][world_size][0]["resume"][case.name]["scale"][0] < 2**19 and not skips[-1]


RESHARD = reshard_cases()


@functools.lru_cache(maxsize=None)
def reference(plan: Reshard) -> dict:
    return reference_run(plan.case, [plan.source] * plan.saved_after + [plan.target] * (plan.case.steps - plan.saved_after))


@pytest.mark.parametrize("plan", RESHARD, ids=[p.name for p in RESHARD])
def test_resharded_continuation_matches_one_process(runs, plan: Reshard) -> None:
    expected = reference(plan)
    ranks = runs[1][plan.target]
    order_sensitive = "muon" in plan.case.optimizer and plan.case.dtype == "fp32" and max(plan.source, plan.target) >= 3
    loss_rtol = 1e-5 if plan.case.dtype == "fp32" and not order_sensitive else 5e-4
    for rank, out in enumerate(ranks):
        result = out[plan.name]
        wanted = [loss for step, r, loss in expected["losses"] if r == rank and step >= plan.saved_after]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(wanted), rtol=loss_rtol, atol=0)
        assert result["skipped"] == expected["skipped"][plan.saved_after:]
        for name, value in result["params"].items():
            assert torch.equal(value, ranks[0][plan.name]["params"][name]), f"rank {rank} diverged on {name}"
    got = ranks[0][plan.name]["params"]
    if plan.case.dtype == "fp32" and not order_sensitive:
        torch.testing.assert_close(got, expected["params"], rtol=0, atol=2e-5)
        return
    initial = fp32_state(make_model(plan.case))
    error = update_error(got, expected["params"], initial)
    assert error < allowed_update_error(plan.case, max(plan.source, plan.target)), f"update error {error:.2e}"


# --- consolidation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case,source", CONSOLIDATE[:2], ids=[c.name for c, _ in CONSOLIDATE[:2]])
def test_consolidated_weights_equal_the_one_process_models(runs, tmp_path, case: Case, source: int) -> None:
    """Offline, from N ranks' shards: the fp32 masters of one process's run, frozen parameters as they were,
    every key of the model's state_dict (the tied head too); load_state_dict(strict=True) takes it."""
    out = tmp_path / "model.safetensors"
    result = consolidate(runs[2] / case.name, out)
    state = load_file(out)
    model = make_model(case)
    assert list(state) == list(model.state_dict()) and result.tensors == len(state)
    model.load_state_dict(state, strict=True)
    expected = reference_run(case, [source] * SAVED_AFTER)["master"]
    initial = fp32_state(make_model(case))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if case.dtype == "fp32":
        torch.testing.assert_close({k: state[k] for k in trainable}, {k: expected[k] for k in trainable}, rtol=0,
                                   atol=2e-5)
    else:
        error = update_error({k: state[k] for k in trainable}, expected, {k: initial[k] for k in trainable})
        assert error < allowed_update_error(case, source), f"update error {error:.2e}"
    compute = DTYPES_BY_NAME[case.dtype]
    for name in set(initial) - trainable:  # frozen: as the run held them, in its compute dtype
        assert torch.equal(state[name], initial[name].to(compute).float()), name
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])
    adapters = tmp_path / "adapters.safetensors"
    consolidate(runs[2] / case.name, adapters, trainable_only=True)
    assert set(load_file(adapters)) == trainable | ({"lm_head.weight"} if "wte.weight" in trainable else set())


def test_consolidated_hugging_face_directory_loads_with_from_pretrained(runs, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    case = CONSOLIDATE[2][0]
    consolidate(runs[2] / case.name, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    state = load_file(tmp_path / "hf" / "model.safetensors")
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for name, value in model.state_dict().items():
        if name in state:
            assert torch.equal(value, state[name]), name
    expected = reference_run(case, [CONSOLIDATE[2][1]] * SAVED_AFTER)["master"]
    torch.testing.assert_close({k: state[k] for k in expected}, expected, rtol=0, atol=2e-5)
    sharded = consolidate(runs[2] / case.name, tmp_path / "sharded", dtype="bf16", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len({*index["weight_map"].values()}) > 2 and len(sharded.files) == len({*index["weight_map"].values()}) + 2
    half = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "sharded")
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.transformer.h[1].mlp.c_fc.weight, state["transformer.h.1.mlp.c_fc.weight"].bfloat16())


def test_a_parameter_never_stepped_is_saved_without_optimizer_state(runs) -> None:
    """No rank ran TinyGPT's `sometimes` layer before the save: its values are saved, and no state (resumed,
    its first step starts Adam's moments from nothing, as the reference's does)."""
    plan = next(p for p in RESHARD if p.case.name == "never-stepped")
    manifest = read_manifest(checkpoint_directory(runs[2] / plan.name))
    never, used = manifest.params["sometimes.weight"], manifest.params["blocks.0.mlp.0.weight"]
    assert (never.state, never.scalars) == ((), {}) and len(never.parts) == 1
    assert used.state == ("exp_avg", "exp_avg_sq") and used.scalars["step"]["value"] == plan.saved_after
    assert {rank for record in manifest.params.values() for rank, _, _ in record.parts} == set(range(plan.source))
