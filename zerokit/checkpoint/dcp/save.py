"""engine.save_checkpoint(dir, format="dcp"): the training state as a torch.distributed.checkpoint checkpoint
that an FSDP2 or torchtitan job loads with `dcp.load` and `set_state_dict`.

[Note: the state dict a DCP checkpoint holds]
The keys are those of torch's `get_state_dict(model, optimizer)`, under `model` and `optim` as torch's DCP
recipe and torchtitan's checkpointer save them:
    {"model": {fqn: the parameter (the fp32 master of a trainable one) or buffer},
     "optim": {"state": {fqn: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}},
               "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}}
DCP flattens it to `model.<fqn>`, `optim.state.<fqn>.exp_avg`, `optim.param_groups.0.lr`, ... Each rank writes
the runs of elements it holds (its masters and their per-element state), as boxes (See [Note: a flat range as
boxes] in boxes.py); a parameter's scalars (Adam's `step`) and the param groups are written by one rank (DCP
deduplicates them). Beside DCP's files, in the same directory, rank 0 writes `zerokit-dcp.json` (what zerokit's
own manifest says of the run: progress, loss scale, the optimizers' classes) and each rank its random generators,
so that zerokit resumes from its own DCP checkpoint exactly; other tools ignore them. The save is atomic as
zerokit's own (See [Note: an atomic save] in ../save.py): DCP writes into the staging directory, which rank 0
moves into place once every rank has written and DCP's `.metadata` is on disk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from zerokit.checkpoint.checkpointed import Checkpointed
from zerokit.checkpoint.collect import RankPayload
from zerokit.checkpoint.commit import CheckpointSaveError, cause, move_into_place, not_saved, write_text
from zerokit.checkpoint.dcp.boxes import Box, box_view, boxes_of_run, run_of
from zerokit.checkpoint.manifest import MASTER, PartRecord, state_key, values_key
from zerokit.checkpoint.optimizer_state import decode_scalar
from zerokit.checkpoint.session import CheckpointGroup

DESCRIPTION = "zerokit-dcp.json"


def rng_file(rank: int) -> str:
    return f"zerokit-rng-rank{rank:05d}.pt"


class Run:
    """A rank's elements [begin, end) of a flattened tensor, written to DCP as boxes."""

    def __init__(self, shape: tuple[int, ...], begin: int, end: int, sources: list[torch.Tensor]) -> None:
        """`sources`: the run's elements, back to back."""
        self.shape, self.begin, self.values = shape, begin, run_of(sources, 0, end - begin)
        self.boxes = {box.offsets: box for box in boxes_of_run(shape, begin, end)}

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:  # DCP's protocol (DTensor's too)
        properties = TensorProperties.create_from_tensor(self.values)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(box.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(box.offsets),
                                                                                 torch.Size(box.sizes)),
                                                      properties=properties, size=torch.Size(self.shape)))
                for box in self.boxes.values()]

    def box(self, offsets: tuple[int, ...]) -> torch.Tensor:
        box: Box = self.boxes[tuple(offsets)]
        return box_view(self.values, self.begin, box)


class RunsSavePlanner(DefaultSavePlanner):
    """DCP's planner, which finds a Run's boxes by their offsets."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Run):
            return value.box(tuple(index.offset))
        return super().lookup_object(index)


def refuse_unsavable(engine: Checkpointed) -> None:
    """What a DCP checkpoint in torch's layout cannot hold, refused in one line before anything is written."""
    if len(engine.view.optimizers) != 1:
        raise ValueError(f"format='dcp' saves one optimizer, as torch's get_state_dict does; this engine steps "
                         f"{len(engine.view.optimizers)}: save it in zerokit's format (format='zerokit')")
    if engine.layout is not None and (engine.layout.pipeline > 1 or engine.layout.tensor > 1):
        raise ValueError("format='dcp' saves a data-parallel engine (ZeRO 0-3, hybrid sharding included); this one "
                         "is part of a pipeline or tensor-parallel layout: save it in zerokit's format "
                         "(format='zerokit')")


def save_dcp(engine: Checkpointed, group: CheckpointGroup, payload: RankPayload, rng: Any, staging: Path,
             save_dir: Path, tag: str, description: dict[str, Any], save_latest: bool,
             failed_before: str | None) -> None:
    """Write this rank's part of the state (See [Note: the state dict a DCP checkpoint holds]) and commit."""
    groups = _param_groups(engine, group)  # a collective: before anything that one rank alone may raise
    state: dict[str, Any] = {}
    try:
        state = {"model": {}, "optim": {"state": {}, "param_groups": groups}}
        _add_parts(state, engine.module, payload)
    except ValueError as error:
        failed_before = failed_before or f"rank {group.rank}: {error}"
    _write_and_commit(group, state, rng, staging, save_dir, tag, description, save_latest, failed_before)


def _add_parts(state: dict[str, Any], module: torch.nn.Module, payload: RankPayload) -> None:
    """This rank's runs of every parameter and buffer it saves, under each of its names, and their optimizer
    state."""
    entries = {entry.spec.key: entry.sources for entry in payload.entries}
    aliases = _aliases(module)
    for part in payload.parts:
        run = Run(part.shape, part.begin, part.end, entries[values_key(part.name, part.role)])
        for name in aliases.get(part.name, [part.name]):
            state["model"][name] = run
        if part.role == MASTER and (part.state or part.scalars):
            state["optim"]["state"][part.name] = _optimizer_state(part, entries)


def _aliases(module: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter's state-dict names by its first name (a tied parameter has several)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {found[0]: found for found in names.values()}


def _optimizer_state(part: PartRecord, entries: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    """A parameter's optimizer state as torch's optimizer holds it: tensors shaped like the parameter (this rank's
    run of them), scalars as they were."""
    state: dict[str, Any] = {}
    for key in part.state:
        sources = entries[state_key(key, part.name)]
        if part.whole_tensor and tuple(sources[0].shape) != tuple(part.shape):
            raise ValueError(f"optimizer state {key!r} of {part.name!r} has shape {tuple(sources[0].shape)}, not the "
                             f"parameter's {tuple(part.shape)}: a DCP checkpoint holds per-element state only; save "
                             "it in zerokit's format")
        state[key] = Run(part.shape, part.begin, part.end, sources)
    for key, encoded in part.scalars.items():
        state[key] = decode_scalar(encoded, torch.device("cpu"))
    return state


def _param_groups(engine: Checkpointed, group: CheckpointGroup) -> list[dict[str, Any]]:
    """The optimizer's param groups as torch's get_state_dict writes them: hyperparameters and the names of the
    parameters in each (every rank's, gathered: a rank holds pieces of some parameters only)."""
    group_of = param_group_of(engine, group)
    order = [name for name, _ in engine.module.named_parameters() if name in group_of]
    return [{**{key: value for key, value in hyperparameters.items() if key != "params"},
             "params": [name for name in order if group_of[name] == index]}
            for index, hyperparameters in enumerate(engine.view.optimizers[0].param_groups)]


def param_group_of(engine: Checkpointed, group: CheckpointGroup) -> dict[str, int]:
    """Every trainable parameter's param group, by name (gathered: a rank holds pieces of some parameters only)."""
    held = {param.name: param.pieces[0].group for param in engine.view.trainable()}
    group_of: dict[str, int] = {}
    for found in group.all_gather(held):
        group_of.update(found)
    return group_of


def _write_and_commit(group: CheckpointGroup, state: dict[str, Any], rng: Any, staging: Path, save_dir: Path,
                         tag: str, description: dict[str, Any], save_latest: bool,
                         failed_before: str | None) -> None:
    """DCP writes every rank's boxes into the staging directory; rank 0 adds the description and moves it into place.
    A failure on any rank is every rank's one line, and leaves nothing (See [Note: a save that fails] in commit.py)."""
    failed = [e for e in group.all_gather(failed_before) if e]  # every rank enters DCP's collectives, or none does
    if not failed:
        error = None
        try:
            dcp_save(state, storage_writer=FileSystemWriter(staging, sync_files=True), planner=RunsSavePlanner(),
                     process_group=group.group, no_dist=group.group is None)
            torch.save(rng, staging / rng_file(group.rank))
        except Exception as failure:  # DCP raises on every rank alike; each must reach the gather below
            error = f"rank {group.rank}: {cause(failure)} while writing the DCP files"
        failed = [e for e in group.all_gather(error) if e]
    commit_error = None
    if group.rank == 0 and not failed:
        try:
            write_text(staging / DESCRIPTION, json.dumps(description, indent=1))
            move_into_place(staging, save_dir, tag, save_latest)
        except OSError as failure:
            commit_error = f"rank 0: {cause(failure)} while committing it"
    if group.rank == 0 and (failed or commit_error):
        shutil.rmtree(staging, ignore_errors=True)
    why = failed[0] if failed else group.all_gather(commit_error)[0]
    if why:
        raise CheckpointSaveError(not_saved(tag, save_dir, why))
