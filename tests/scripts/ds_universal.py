"""The way back, for tests/test_deepspeed_export.py: zerokit (its DeepSpeed drop-in) trains the tiny model of
ds_checkpoints.py (a frozen parameter, a buffer, two param groups, a tied weight) and saves; after `zerokit
convert`, real DeepSpeed loads the universal checkpoint with `"checkpoint": {"load_universal": true}` at each
stage of a sweep and trains on; zerokit's own continuation is the reference.

    spawn(ds_universal.zerokit_train, 2, root, [(3, "fp32")])        # root/zk-fp32, and zerokit's continuation
    spawn(ds_universal.deepspeed_resume, 2, root, [(1, "fp32"), (3, "fp32")])   # root/universal-fp32, in turn
    spawn(ds_universal.zerokit_then_deepspeed, 1, root, 2, [(2, "fp32")])       # another world size: both sides

Each returns, per rank, what the test compares: losses of the steps after the save, the fp32 weights they end at
(rank 0), and what the loaded engine says of its counters and param groups.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import torch
import torch.distributed as dist

import ds_checkpoints as model_side
from ds_checkpoints import STEPS_AFTER, STEPS_BEFORE, build_model, make_optimizer, train

AFTER = range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
CLIENT_STATE = {"epoch": 4, "note": "from zerokit"}


def _environment(rank: int, world_size: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def _zerokit_engine(stage: int, precision: str):
    import zerokit.deepspeed

    model = build_model()
    engine, *_ = zerokit.deepspeed.initialize(model=model, optimizer=make_optimizer(model),
                                              config=model_side.ds_config(stage, precision))
    return engine


def zerokit_train(rank: int, world_size: int, root: str, cases: list[tuple[int, str]]) -> dict[str, dict]:
    """Per (stage, precision): train STEPS_BEFORE steps, save root/zk-<precision>, then continue: zerokit's own
    continuation."""
    _environment(rank, world_size)
    results = {}
    for stage, precision in cases:
        engine = _zerokit_engine(stage, precision)
        train(engine, range(STEPS_BEFORE), rank)
        engine.save_checkpoint(str(Path(root) / f"zk-{precision}"), client_state=CLIENT_STATE)
        losses = train(engine, AFTER, rank)
        weights = engine.full_state_dict()
        engine.close()
        results[precision] = {"losses": losses, "weights": weights if rank == 0 else None}
    return results


def zerokit_resume(rank: int, world_size: int, root: str, stage: int, precision: str) -> dict:
    """zerokit's own continuation of root/zk-<precision> at this world size."""
    _environment(rank, world_size)
    engine = _zerokit_engine(stage, precision)
    engine.load_checkpoint(str(Path(root) / f"zk-{precision}"))
    losses = train(engine, AFTER, rank)
    weights = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "weights": weights if rank == 0 else None}


def _gathered_weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # a no-op below stage 3
        return {key: value.detach().float().clone() for key, value in engine.module.state_dict().items()}


def unshare_steps(engine) -> bool:
    """Give each of the optimizer's flat groups its own step tensor; returns whether they shared one. DeepSpeed
    0.19.8's ZeRO-3 universal load hands every sub-group the one `step` tensor it read
    (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3), and Adam counts `step += 1` in place, so with
    two param groups each step after the load counts twice (for a checkpoint its own ds_to_universal wrote too)."""
    steps = [state["step"] for state in engine.optimizer.optimizer.state.values() if "step" in state]
    shared = len({id(step) for step in steps}) < len(steps)
    for state in engine.optimizer.optimizer.state.values():
        if "step" in state:
            state["step"] = state["step"].clone()
    return shared


def deepspeed_stage(rank: int, root: str, stage: int, precision: str, unshare: bool, save: bool = False) -> dict:
    """Real DeepSpeed loads root/universal-<precision> at `stage` and trains on (unshare: after unshare_steps);
    save: then saves its own checkpoint under root/ds (for ds_to_universal)."""
    import deepspeed

    config = {**model_side.ds_config(stage, precision), "checkpoint": {"load_universal": True}}
    model = build_model()
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config)
        path, client_state = engine.load_checkpoint(str(Path(root) / f"universal-{precision}"))
        loaded = {"path": path, "client_state": {k: client_state.get(k) for k in CLIENT_STATE},
                  "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                  "skipped_steps": engine.skipped_steps, "lr": engine.get_lr(),
                  "scheduler": engine.lr_scheduler.state_dict(),
                  "weight_decay": [group["weight_decay"] for group in engine.optimizer.param_groups],
                  "steps": [float(state["step"]) for state in engine.optimizer.optimizer.state.values()],
                  "shared_step": unshare_steps(engine) if unshare else None}
        losses = train(engine, AFTER, rank)
        weights = _gathered_weights(engine)
        if save:
            engine.save_checkpoint(str(Path(root) / "ds"))
        engine.destroy()
    return {"losses": losses, "weights": weights if rank == 0 else None, "loaded": loaded}


def _deepspeed_comm() -> None:
    import deepspeed

    import zerokit.testing.deepspeed_peer  # noqa: F401  (no shared-memory op built: See its Note)

    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo")


def deepspeed_resume(rank: int, world_size: int, root: str, cases: list[tuple[int, str]], unshare: bool = True,
                     save_case: tuple[int, str] | None = None) -> dict[tuple[int, str], dict]:
    """Each (stage, precision) of `cases`, one DeepSpeed engine after another in this launch; the one at
    save_case saves."""
    _environment(rank, world_size)
    _deepspeed_comm()
    results = {(stage, precision): deepspeed_stage(rank, root, stage, precision, unshare,
                                                   (stage, precision) == save_case)
               for stage, precision in cases}
    dist.barrier()
    return results


def zerokit_then_deepspeed(rank: int, world_size: int, root: str, zerokit_stage: int,
                           cases: list[tuple[int, str]]) -> dict:
    """At a world size other than the saving run's (fp32): zerokit's continuation, then DeepSpeed's per case."""
    reference = zerokit_resume(rank, world_size, root, zerokit_stage, "fp32")
    return {"zerokit": reference, "deepspeed": deepspeed_resume(rank, world_size, root, cases)}
