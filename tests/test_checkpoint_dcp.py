"""Checkpoints in torch.distributed.checkpoint's format (issue 46): zerokit saves what an FSDP2 job loads with
`dcp.load` + `set_state_dict` and continues from, and loads what an FSDP2 job saved, at any stage and world size.

One spawn of 2 gloo ranks trains, saves and continues every run whose world size is 2 (zerokit at stages 3 and 1,
FSDP2, each from the other's checkpoint); one spawn of 3 ranks loads the 2-rank checkpoints (a world size that
divides no parameter) and checks the bad inputs. The peers continue on the same batches, so a continuation from
the other's checkpoint is compared with the run that saved it: exact where zerokit continues its own checkpoint
at the same world size and stage, within 1e-5 (relative) where the other continues (FSDP2 reduces its gradients in
another order).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerokit
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups, rank_batch, small_zero_config
from zerokit.testing.spawn import spawn

BEFORE, AFTER = 2, 2  # optimizer steps before the save, and after it
# Another tool's continuation adds the same gradients in another order: tests/test_parity.py's fp32 tolerances (losses
# rtol 1e-5; parameters atol 2e-5, under 1% of one Adam step, where Adam's division by sqrt(v) enlarges an ulp of a
# near-zero gradient). Measured here: on 2 ranks FSDP2 and zerokit continue bit for bit alike; on 3, losses equal,
# parameters within 3.3e-6.
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5


def _batch(step: int) -> torch.Tensor:
    """This rank's tokens: TinyGPT's data-dependent layer used on every rank (FSDP2 reduces the gradients of a
    layer only some ranks used with mismatched sizes)."""
    tokens = rank_batch(dist.get_rank(), step)
    tokens[0, 0] = 3
    return tokens


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig())


def _optimizer(model: torch.nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(param_groups(model), lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95))


def _engine(stage: int, kind: str = "adamw", model: torch.nn.Module | None = None) -> zerokit.Engine:
    model = model or _model()
    return zerokit.initialize(model=model, optimizer=_optimizer(model, kind),
                              config={**small_zero_config(stage), "train_micro_batch_size_per_gpu": 2})


def _zerokit_steps(engine: zerokit.Engine, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        tokens = _batch(step)
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _fsdp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, _optimizer(model)


def _fsdp_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        tokens = _batch(step)
        loss = lm_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _fsdp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optimizer_state}


def _fsdp_load(checkpoint: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A torchtitan-style FSDP2 job resuming: torch's recipe (dcp.load into get_state_dict's dict, set_state_dict)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    model, optimizer = _fsdp()
    state = _fsdp_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(checkpoint))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optimizer


def _fsdp_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for name, value in model.state_dict().items()}


def _continued(losses: list[float], weights: dict[str, torch.Tensor]) -> dict:
    return {"losses": losses, "weights": weights}


def on_two_ranks(rank: int, world_size: int, root: str) -> dict:
    root, runs = Path(root), {}
    engine = _engine(stage=3)
    _zerokit_steps(engine, 0, BEFORE)
    engine.save_checkpoint(root / "zerokit-dcp", format="dcp")
    engine.save_checkpoint(root / "zerokit-own")
    runs["zerokit"] = _continued(_zerokit_steps(engine, BEFORE, AFTER), engine.full_state_dict())
    for stage in (3, 1):
        engine = _engine(stage)
        engine.load_checkpoint(root / "zerokit-dcp")
        runs[f"zerokit-s{stage}-from-dcp"] = _continued(_zerokit_steps(engine, BEFORE, AFTER), engine.full_state_dict())
    model, optimizer = _fsdp_load(root / "zerokit-dcp" / f"global_step{BEFORE}")
    runs["fsdp-from-zerokit"] = _continued(_fsdp_steps(model, optimizer, BEFORE, AFTER), _fsdp_weights(model))

    import torch.distributed.checkpoint as dcp
    model, optimizer = _fsdp()
    _fsdp_steps(model, optimizer, 0, BEFORE)
    dcp.save(_fsdp_state(model, optimizer), checkpoint_id=str(root / "fsdp"))
    dcp.save(_torchtitan_state(model, optimizer), checkpoint_id=str(root / "torchtitan"))
    dcp.save({"app": _fsdp_state(model, optimizer)}, checkpoint_id=str(root / "app"))  # torch's AppState example
    runs["fsdp"] = _continued(_fsdp_steps(model, optimizer, BEFORE, AFTER), _fsdp_weights(model))
    for stage, source in ((2, "fsdp"), (3, "torchtitan"), (1, "app")):
        engine = _engine(stage)
        engine.load_checkpoint(root / source)
        runs[f"zerokit-from-{source}"] = _continued(_zerokit_steps(engine, BEFORE, AFTER), engine.full_state_dict())
    return runs


def _torchtitan_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """torchtitan's checkpointer's layout: the model's names at the top, the optimizer flattened under `optimizer`
    (each parameter naming its group's hyperparameters), its own counters beside them."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    return {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
            "train_state": {"step": BEFORE}}


def _error(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def on_three_ranks(rank: int, world_size: int, root: str) -> dict:
    root, runs = Path(root), {}
    for name, source in (("from-dcp", "zerokit-dcp"), ("from-own", "zerokit-own")):
        engine = _engine(stage=3)
        engine.load_checkpoint(root / source)
        runs[name] = _continued(_zerokit_steps(engine, BEFORE, AFTER), engine.full_state_dict())
    model, optimizer = _fsdp_load(root / "zerokit-dcp" / f"global_step{BEFORE}")
    runs["fsdp-from-dcp"] = _continued(_fsdp_steps(model, optimizer, BEFORE, AFTER), _fsdp_weights(model))
    other = TinyGPT(TinyGPTConfig(n_layer=3))
    runs["errors"] = {
        "another model": _error(lambda: _engine(1, model=other).load_checkpoint(root / "fsdp")),
        "another optimizer": _error(lambda: _engine(1, kind="sgd").load_checkpoint(root / "fsdp")),
        "unknown format": _error(lambda: _engine(1).save_checkpoint(root / "never", format="torch")),
    }
    engine = _engine(stage=1)
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": engine.full_state_dict()}, checkpoint_id=str(root / "weights-only"))
    fresh = _engine(stage=3)
    fresh.load_checkpoint(root / "weights-only")
    runs["weights-only"] = fresh.full_state_dict()
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dcp")
    two = spawn(on_two_ranks, 2, str(root), timeout=300)
    three = spawn(on_three_ranks, 3, str(root), timeout=300)
    return {"two": two[0], "three": three[0], "root": root}


def _assert_continues(run: dict, reference: dict, exact: bool) -> None:
    losses, weights = ({"rtol": 0, "atol": 0},) * 2 if exact else ({"rtol": LOSS_RTOL, "atol": 0},
                                                                    {"rtol": 0, "atol": PARAM_ATOL})
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), **losses)
    assert run["weights"].keys() == reference["weights"].keys()
    for name, value in reference["weights"].items():
        torch.testing.assert_close(run["weights"][name].float(), value.float(), **weights, msg=name)


def test_zerokit_resumes_its_dcp_checkpoint_exactly_at_the_same_world_size_and_stage(runs) -> None:
    _assert_continues(runs["two"]["zerokit-s3-from-dcp"], runs["two"]["zerokit"], exact=True)


def test_zerokit_resumes_its_dcp_checkpoint_at_another_stage(runs) -> None:
    _assert_continues(runs["two"]["zerokit-s1-from-dcp"], runs["two"]["zerokit"], exact=False)


def test_fsdp2_continues_from_zerokits_dcp_checkpoint_as_zerokit_does(runs) -> None:
    _assert_continues(runs["two"]["fsdp-from-zerokit"], runs["two"]["zerokit"], exact=False)


def test_zerokit_continues_from_fsdp2s_checkpoint_as_fsdp2_does(runs) -> None:
    _assert_continues(runs["two"]["zerokit-from-fsdp"], runs["two"]["fsdp"], exact=False)


@pytest.mark.parametrize("layout", ["torchtitan", "app"])
def test_zerokit_continues_from_the_other_layouts_as_fsdp2_does(runs, layout: str) -> None:
    _assert_continues(runs["two"][f"zerokit-from-{layout}"], runs["two"]["fsdp"], exact=False)


def test_at_another_world_size_dcp_resumes_as_zerokits_own_format(runs) -> None:
    """Saved by 2 ranks, loaded by 3: the same values as zerokit's own format gives, which tests/
    test_checkpoint_multirank.py holds to one process; FSDP2 on 3 ranks continues alike."""
    _assert_continues(runs["three"]["from-dcp"], runs["three"]["from-own"], exact=True)
    _assert_continues(runs["three"]["fsdp-from-dcp"], runs["three"]["from-own"], exact=False)


def test_a_checkpoint_without_an_optimizer_loads_the_weights(runs) -> None:
    reference = runs["two"]["fsdp"]  # unrelated values would fail; the saved ones are the stage-1 engine's init
    weights = runs["three"]["weights-only"]
    assert weights.keys() == reference["weights"].keys()
    initial = _model().state_dict()
    for name, value in weights.items():
        torch.testing.assert_close(value, initial[name].float(), rtol=0, atol=0, msg=name)


def test_the_checkpoint_is_laid_out_as_torchs_get_state_dict(runs) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(runs["root"] / "zerokit-dcp" / f"global_step{BEFORE}")).read_metadata()
    fsdp = FileSystemReader(str(runs["root"] / "fsdp")).read_metadata()
    assert set(keys.state_dict_metadata) == set(fsdp.state_dict_metadata)


@pytest.mark.parametrize("case, message", [
    ("another model", "the DCP checkpoint's model keys do not match this model: missing 'blocks.2.ln_1.weight'"),
    ("another optimizer", "saved by an optimizer with hyperparameter 'amsgrad', which this SGD does not have"),
    ("unknown format", "format='torch' is not known; accepted: zerokit, dcp"),
])
def test_bad_input_is_one_line_naming_it(runs, case: str, message: str) -> None:
    error = runs["three"]["errors"][case]
    assert message in error and "\n" not in error, error
