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
    out["shard_bytes"] = engine.stage.trainable.shards.numel() * engine.stage.trainable.shards.element_size()
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
    storage = {p.untyped_storage().nbytes() for p in model.parameters()}
    out = {"storage_bytes": storage, "memory": engine.memory_stats(),
           "shard_bytes": engine.stage.trainable.shards.numel() * 4}
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
    out.update(_load_from_safetensors(rank, case))
    return out


def _load_from_safetensors(rank: int, case: Case) -> dict:
    """Pretrained weights streamed into a meta-built model from a safetensors file holding the tied
    embedding under one name only, as Hugging Face saves it."""
    import tempfile

    from safetensors.torch import save_file

    from zerokit.testing.models import TinyGPT, TinyGPTConfig

    torch.manual_seed(99)
    pretrained = TinyGPT(TinyGPTConfig())
    state = {k: v.clone() for k, v in pretrained.state_dict().items() if k != "lm_head.weight"}
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/model_rank{rank}.safetensors"
        save_file(state, path)
        with torch.device("meta"):
            model = TinyGPT(TinyGPTConfig())
        engine = zerokit.initialize(model, make_optimizer(case, model), engine_config(case),
                                    param_init=zerokit.safetensors_init(model, path))
        loaded = engine.full_state_dict()
    return {"loaded": loaded, "pretrained": pretrained.state_dict()}


def run_stage3_frozen_checks(rank: int, world_size: int) -> dict:
    """A LoRA-like fine-tune at stage 3 (every matrix frozen, the blocks are units), built eagerly and on
    the meta device: what a rank holds of the frozen weights, what it reports, what it saves, and that
    training and edits treat them right."""
    from zerokit.testing.models import TinyGPT, TinyGPTConfig, seeded_init
    from zerokit.testing.parity import freeze

    case = Case("frozen", stage=3, freeze_matrices=True, min_unit_params=100)
    model = make_model(case)
    engine = zerokit.initialize(model, make_optimizer(case, model), engine_config(case))
    out = _frozen_holdings(engine, model)
    out["state_before"] = engine.full_state_dict()
    tokens = make_batch(case, 0, 0, rank)
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
    out["step"] = asdict(engine.step())
    out["state_after"] = engine.full_state_dict()
    out["after_step"] = _frozen_holdings(engine, model)
    with engine.unsharded([model.blocks[1].mlp[0].weight], write_back=True):
        model.blocks[1].mlp[0].weight.data.fill_(0.5)  # every rank makes the same edit
    out["after_edit"] = engine.full_state_dict()["blocks.1.mlp.0.weight"]

    meta_case = Case("frozen-meta", stage=3, meta=True, freeze_matrices=True, min_unit_params=100)
    with torch.device("meta"):
        meta_model = TinyGPT(TinyGPTConfig())
    freeze(meta_model, meta_case)
    meta_engine = zerokit.initialize(meta_model, make_optimizer(meta_case, meta_model), engine_config(meta_case),
                                     param_init=seeded_init(meta_model))
    out["meta"] = _frozen_holdings(meta_engine, meta_model)
    out["meta_state"] = meta_engine.full_state_dict()
    return out


def _frozen_holdings(engine: zerokit.Engine, model: torch.nn.Module) -> dict:
    frozen = [p for p in model.parameters() if not p.requires_grad]
    in_blocks = [(name, p) for name, p in model.blocks.named_parameters() if not p.requires_grad]
    shards = engine.stage.frozen.shards  # this rank's shard of every unit's frozen bucket
    return {
        "frozen_numel": sum(p.numel() for p in frozen),
        "frozen_shard_bytes": shards.numel() * shards.element_size(),
        "frozen_units": len(engine.stage.frozen.layout.buckets),
        "frozen_storage_bytes": {p.untyped_storage().nbytes() for p in frozen},  # what each really holds
        "memory": engine.memory_stats(),
        "trainable_shard_bytes": engine.stage.trainable.shards.numel() * engine.stage.trainable.shards.element_size(),
        "block_frozen_shapes": {name: tuple(p.shape) for name, p in in_blocks},
        "block_frozen_all_nan": all(bool(p.isnan().all()) for _, p in in_blocks),
    }
