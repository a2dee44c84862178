"""Multi-rank scenarios beyond parity: overflow on one rank's shard only, and failing loudly."""

from __future__ import annotations

from dataclasses import asdict

import torch

import zerokit
from zerokit.testing.parity import Case, engine_config, make_batch, make_model, make_optimizer
from zerokit.testing.models import lm_loss


def _poison_on_rank0(model: torch.nn.Module, rank: int, steps: set[int], clock: list[int]) -> None:
    """Make one gradient element inf on rank 0 only, on the given steps. At stage 2 only the rank
    owning that element sees the inf after reduce-scatter, so every rank skipping proves agreement."""
    target = model.blocks[0].ln_1.bias

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if rank == 0 and clock[0] in steps:
            grad = grad.clone()
            grad[0] = float("inf")
        return grad

    target.register_hook(poison)


OVERFLOW_SETTINGS = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("bf16", "fp16")]


def run_overflow_scenarios(rank: int, world_size: int) -> dict:
    """Every stage and 16-bit dtype: {"stage2-bf16": {"agree": ..., "fail_loud": ...}, ...}."""
    return {f"stage{stage}-{dtype}": _overflow_scenarios(rank, Case("overflow", stage=stage, dtype=dtype, steps=4))
            for stage, dtype in OVERFLOW_SETTINGS}


def _overflow_scenarios(rank: int, case: Case) -> dict:
    out = {}
    for name, poisoned, limit in (("agree", {1}, 20), ("fail_loud", set(range(100)), 3)):
        model = make_model(case)
        engine = zerokit.initialize(model, make_optimizer(case, model),
                                    {**engine_config(case), "max_consecutive_skipped_steps": limit})
        clock, results, error, snapshots = [0], [], None, []
        _poison_on_rank0(model, rank, poisoned, clock)
        try:
            for step in range(case.steps):
                clock[0] = step
                tokens = make_batch(case, step, 0, rank)
                engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
                results.append(asdict(engine.step()))
                snapshots.append(engine.full_state_dict())  # gathered, at stage 3 too
        except zerokit.SkippedStepsError as raised:
            error = str(raised)
        out[name] = {"results": results, "error": error, "snapshots": snapshots}
    return out


def run_stage3_access(rank: int, world_size: int) -> dict:
    """What a user can do with sharded parameters between steps: ask their shape, gather them to read
    or edit, run inference, save a full state dict."""
    case = Case("access", stage=3)
    model = make_model(case)
    engine = zerokit.initialize(model, make_optimizer(case, model), engine_config(case))
    weight = model.blocks[0].mlp[0].weight
    out = {"shape": tuple(weight.shape), "dtype": str(weight.dtype), "sharded_is_nan": bool(weight.isnan().all())}
    before = engine.comm_stats()["all_gather"]["calls"]
    with engine.unsharded():
        out["gathered"] = weight.detach().clone()
        tokens = make_batch(case, 0, 0, rank)
        with torch.no_grad():
            out["logits_in_context"] = engine(tokens[:, :-1]).clone()
            engine(tokens[:, :-1])  # a second "token": nothing more is gathered
    out["gathers_in_context"] = engine.comm_stats()["all_gather"]["calls"] - before
    out["state"] = engine.full_state_dict()
    with torch.no_grad():
        out["logits_eval"] = engine(tokens[:, :-1]).clone()  # plain no-grad forward: gather, use, free
    out["memory_after_eval"] = engine.memory_stats()
    out["shard_bytes"] = engine.stage.shards.numel() * engine.stage.shards.element_size()
    with engine.unsharded([model.ln_f.bias], write_back=True):
        model.ln_f.bias.data.fill_(0.25)  # every rank makes the same edit
    out["after_edit"] = engine.full_state_dict()["ln_f.bias"]
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
    engine.step()
    out["after_step"] = engine.full_state_dict()["ln_f.bias"]
    return out


def run_meta_construction_checks(rank: int, world_size: int) -> dict:
    """A meta-built model ends up holding shards only; ranks that initialise differently are caught."""
    from zerokit.testing.models import TinyGPT, TinyGPTConfig, seeded_init

    case = Case("meta", stage=3, meta=True)
    with torch.device("meta"):
        model = TinyGPT(TinyGPTConfig())
    engine = zerokit.initialize(model, make_optimizer(case, model), engine_config(case), param_init=seeded_init(model))
    storage = {p.untyped_storage().nbytes() for p in model.parameters() if p.requires_grad}
    out = {"trainable_storage_bytes": storage, "memory": engine.memory_stats(),
           "shard_bytes": engine.stage.shards.numel() * 4}
    with torch.device("meta"):
        divergent = TinyGPT(TinyGPTConfig())
    seeded = seeded_init(divergent)

    def rank_dependent(module: torch.nn.Module) -> None:
        seeded(module)
        for param in module.parameters(recurse=False):
            param.data.add_(rank)

    try:
        zerokit.initialize(divergent, make_optimizer(case, divergent), engine_config(case), param_init=rank_dependent)
    except ValueError as error:
        out["divergent_error"] = str(error)
    return out
