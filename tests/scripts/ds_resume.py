"""zerokit resumes the checkpoints tests/scripts/ds_checkpoints.py had real DeepSpeed write, and trains on with
the same global batches as DeepSpeed's own continuation, for tests/test_deepspeed_import.py.

    zerokit.testing.spawn.spawn(ds_resume.resume_all, 2, root, [("stage2_fp32_w3", 3), ...])

Each case (the DeepSpeed case's folder, the zerokit stage) returns, per rank: what load_checkpoint returned and
restored (client_state, counters, learning rates), each continued step's loss as (mean over this rank's
sequences, their count), and on rank 0 the fp32 masters as loaded and as the steps end them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ds_checkpoints as ds


def global_batch(step: int, saved_world_size: int) -> torch.Tensor:
    """The sequences every DeepSpeed rank trained on at `step`, in rank order."""
    return torch.cat([ds.batch(step, rank) for rank in range(saved_world_size)])


def fp32_masters(engine) -> dict[str, torch.Tensor] | None:
    """Every trainable parameter's fp32 master, whole, on rank 0 (None elsewhere), joined from every rank's
    optimizer pieces."""
    pieces = [(param.name, piece.begin, piece.values.detach().reshape(-1).float().clone())
              for param in engine.view.trainable() for piece in param.pieces]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    if dist.get_rank() != 0:
        return None
    shapes = {slot.name: slot.shape for bucket in engine.view.layout.buckets for slot in bucket.slots}
    whole = {name: torch.full((torch.Size(shape).numel(),), float("nan")) for name, shape in shapes.items()}
    for rank_pieces in gathered:
        for name, begin, values in rank_pieces:
            whole[name][begin:begin + values.numel()] = values
    return {name: tensor.view(shapes[name]) for name, tensor in whole.items()}


def resume_case(root: Path, case: str, stage: int, rank: int, world_size: int) -> dict[str, Any]:
    import zerokit.deepspeed as deepspeed

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))  # as DeepSpeed's launcher
    saved_world_size, precision = int(case.rsplit("_w", 1)[1]), case.split("_")[1]
    model = ds.build_model(seed=99)  # other weights than the checkpoint's: the load must replace them
    config = ds.ds_config(stage, precision)
    config["train_micro_batch_size_per_gpu"] = ds.BATCH * saved_world_size // world_size or 1
    engine, *_ = deepspeed.initialize(model=model, optimizer=ds.make_optimizer(model), config=config)
    path, client_state = engine.load_checkpoint(str(root / case / "ckpt"), load_module_strict=True,
                                                load_optimizer_states=True, load_lr_scheduler_states=True)
    result = {"path": path, "client_state": client_state, "global_steps": engine.global_steps, "lr": engine.get_lr(),
              "weight_decay": [g["weight_decay"] for g in engine.optimizer.param_groups], "losses": [],
              "loaded": fp32_masters(engine)}
    for step in range(ds.STEPS_BEFORE, ds.STEPS_BEFORE + ds.STEPS_AFTER):
        share = torch.tensor_split(global_batch(step, saved_world_size), world_size)[rank]
        loss = engine(share)
        # ranks' gradients are averaged: weigh each rank's mean by its share of the sequences
        engine.backward(loss * share.shape[0] * world_size / (ds.BATCH * saved_world_size))
        engine.step()
        result["losses"].append((loss.item(), share.shape[0]))
    result["masters"] = fp32_masters(engine)
    engine.destroy()
    return result


def resume_all(rank: int, world_size: int, root: str, cases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [resume_case(Path(root), case, stage, rank, world_size) for case, stage in cases]


def failed_loads(rank: int, world_size: int, directories: list[str | list[str]],
                 extra_param: list[bool]) -> list[dict[str, Any]]:
    """Each load of a bad DeepSpeed checkpoint into a 2-rank stage-2 engine (a list: each rank's own directory, as
    where one node's copy is damaged): the error this rank raised, and whether the engine's weights and masters
    are still those it had before (nothing of the failed load restored)."""
    import zerokit.deepspeed as deepspeed

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    results = []
    for directory, extra in zip(directories, extra_param):
        model = ds.build_model(seed=99)
        if extra:
            model.extra = torch.nn.Linear(2, 2)  # another model: one more layer
        engine, *_ = deepspeed.initialize(model=model, optimizer=ds.make_optimizer(model),
                                          config=ds.ds_config(2, "fp32"))
        before, masters = engine.full_state_dict(), fp32_masters(engine)
        try:
            engine.load_checkpoint(directory if isinstance(directory, str) else directory[rank])
            error = None
        except ValueError as failure:
            error = str(failure)
        after, masters_after = engine.full_state_dict(), fp32_masters(engine)
        unchanged = all(torch.equal(before[k], after[k]) for k in before) and (
            masters is None or all(torch.equal(masters[k], masters_after[k]) for k in masters))
        results.append({"error": error, "unchanged": unchanged, "steps": engine.global_steps})
        engine.destroy()
    return results
