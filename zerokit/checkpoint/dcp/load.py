"""engine.load_checkpoint(dir) of a torch.distributed.checkpoint directory: one zerokit saved with format="dcp", or
one an FSDP2 or torchtitan job saved with `dcp.save({"model": ..., "optim": ...})` (See [Note: the state dict a DCP
checkpoint holds] in save.py), at any stage and world size.

[Note: a DCP checkpoint read by runs]
Each rank asks DCP for the boxes of the runs it holds (its optimizer pieces' masters and per-element state, its
frozen parts, the buffers: See [Note: a flat range as boxes] in boxes.py), each box read straight into the piece's
memory; DCP's resharding finds which saved chunks overlap them, so nothing else is read. Where the keys sit is
found from the model's own names: `model.<fqn>` as torch's recipe saves them (`app.model.<fqn>` and bare `<fqn>`
too), the optimizer beside it under `optim` or `optimizer`. A checkpoint from another tool has no zerokit
description: its model and optimizer are loaded, its hyperparameters too, and the counters, LR schedules and random
generators stay as they are (said in one line), since the tool keeps those in its own keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list

from zerokit.checkpoint.checkpointed import Checkpointed
from zerokit.checkpoint.commit import LATEST
from zerokit.checkpoint.dcp.boxes import Box, box_view, boxes_of_run
from zerokit.checkpoint.dcp.save import DESCRIPTION, rng_file
from zerokit.checkpoint.manifest import Manifest
from zerokit.checkpoint.rng import restore_rng
from zerokit.stages.view import PieceView

METADATA = ".metadata"
MODEL_PREFIXES = ("model.", "app.model.", "")
OPTIMIZER_PREFIXES = ("optim.", "optimizer.", "app.optim.", "app.optimizer.")


def dcp_directory(load_dir: str | os.PathLike, tag: str | None) -> Path | None:
    """The DCP checkpoint at load_dir (itself, or its tag, or the tag `latest` names); None if there is none."""
    load_dir = Path(load_dir)
    if tag is None and (load_dir / METADATA).is_file():
        return load_dir
    if tag is None and (load_dir / LATEST).is_file():
        tag = (load_dir / LATEST).read_text().strip()
    return load_dir / tag if tag is not None and (load_dir / tag / METADATA).is_file() else None


@dataclass
class Reads:
    """What this rank asks of the checkpoint: boxes into its own memory, and objects by key."""

    boxes: dict[str, list[tuple[Box, torch.Tensor]]] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)
    loaded: dict[str, Any] = field(default_factory=dict)

    def run(self, key: str, shape: tuple[int, ...], begin: int, values: torch.Tensor) -> None:
        """Elements [begin, begin + values.numel()) of the saved tensor `key` into `values`."""
        for box in boxes_of_run(shape, begin, begin + values.numel()):
            self.boxes.setdefault(key, []).append((box, box_view(values, begin, box)))

    def whole(self, key: str, saved: Any) -> None:
        """The value of `key` whole, into `loaded` once read: a tensor (a 0-dim `step`, a tensor learning rate) or
        a pickled object."""
        if key in self.loaded or key in self.objects:  # asked for by another piece of the parameter
            return
        if isinstance(saved, BytesStorageMetadata):
            self.objects.append(key)
            return
        self.loaded[key] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
        self.run(key, tuple(saved.size), 0, self.loaded[key])


class RunsLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading the boxes and objects of `reads` (See [Note: a DCP checkpoint read by runs])."""

    def __init__(self, reads: Reads, weights_only: bool) -> None:
        super().__init__(flatten_state_dict=False)
        self.reads, self.weights_only = reads, weights_only

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for key, boxes in self.reads.boxes.items():
            chunks = [ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)) for box, _ in boxes]
            items += create_read_items_for_chunk_list(key, saved[key], chunks)
        for key in self.reads.objects:
            items += _create_read_items(key, saved[key], None)
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.reads.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=self.weights_only)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.reads.boxes[index.fqn][index.index][1]


@dataclass
class DcpKeys:
    """Where a checkpoint keeps the model's and the optimizer's values (See [Note: a DCP checkpoint read by runs])."""

    metadata: Metadata
    model: str  # the prefix of the model's keys
    optimizer: str | None  # the prefix of the optimizer's, None: the checkpoint has no optimizer
    group_of: dict[str, int]  # this engine's param group of each trainable parameter, by name

    def tensor(self, key: str) -> TensorStorageMetadata | None:
        found = self.metadata.state_dict_metadata.get(key)
        return found if isinstance(found, TensorStorageMetadata) else None

    def state_of(self, name: str) -> dict[str, Any]:
        """A parameter's saved optimizer state: its keys' names and their metadata."""
        prefix = f"{self.optimizer}state.{name}."
        return {key[len(prefix):]: value for key, value in self.metadata.state_dict_metadata.items()
                if key.startswith(prefix) and "." not in key[len(prefix):]}

    def groups(self) -> dict[int, dict[str, str]]:
        """Each saved param group's hyperparameters: name -> key. torch's get_state_dict numbers the groups
        (`param_groups.0.lr`); with flatten_optimizer_state_dict (torchtitan's) each parameter names its own
        (`param_groups.<fqn>.lr`), read here as the group this engine puts that parameter in."""
        prefix, groups = f"{self.optimizer}param_groups.", {}
        for key in self.metadata.state_dict_metadata:
            if not key.startswith(prefix):
                continue
            index, _, name = key[len(prefix):].partition(".")
            if index.isdigit() and name and "." not in name:
                groups.setdefault(int(index), {})[name] = key
                continue
            owner, _, name = key[len(prefix):].rpartition(".")
            if owner in self.group_of:
                groups.setdefault(self.group_of[owner], {}).setdefault(name, key)
        return groups


def find_keys(directory: Path, metadata: Metadata, names: dict[str, tuple[int, ...]],
              group_of: dict[str, int]) -> DcpKeys:
    """The prefixes the model's names sit under, checked: every name there with its shape, no other."""
    saved = metadata.state_dict_metadata
    first = next(iter(names))
    prefix = next((p for p in MODEL_PREFIXES if p + first in saved), None)
    if prefix is None:
        raise ValueError(f"{directory}: a DCP checkpoint without this model's {first!r} (looked for "
                         f"{', '.join(repr(p + first) for p in MODEL_PREFIXES)})")
    optimizer = next((p for p in OPTIMIZER_PREFIXES if any(key.startswith(p + "state.") for key in saved)), None)
    keys = DcpKeys(metadata, prefix, optimizer, group_of)
    missing = [name for name in names if keys.tensor(prefix + name) is None]
    unexpected = [key[len(prefix):] for key in saved if prefix and key.startswith(prefix)
                  and key[len(prefix):] not in names]  # bare names sit beside the run's other keys: not checked
    if missing or unexpected:
        what = [f"missing {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")] if missing \
            else []
        what += [f"unexpected {unexpected[0]!r}" + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else "")
                 ] if unexpected else []
        raise ValueError(f"{directory}: the DCP checkpoint's model keys do not match this model: {'; '.join(what)}")
    for name, shape in names.items():
        if tuple(keys.tensor(prefix + name).size) != shape:
            raise ValueError(f"{directory}: {prefix + name!r} has shape {tuple(keys.tensor(prefix + name).size)} "
                             f"there, {shape} here")
    return keys


def read_description(directory: Path) -> Manifest | None:
    """zerokit's description of its own DCP checkpoint, as a manifest without parts; None from another tool."""
    path = directory / DESCRIPTION
    if not path.is_file():
        return None
    return Manifest(**json.loads(path.read_text()), params={}, files={}, rng={})


def plan_reads(engine: Checkpointed, keys: DcpKeys, with_state: bool, directory: Path) -> tuple[Reads, list]:
    """Every run this rank holds, as reads; and for each optimizer piece, the state it will get."""
    view, reads, states = engine.view, Reads(), []
    for param in view.trainable():
        for piece in param.pieces:
            reads.run(keys.model + param.name, param.shape, piece.begin, piece.values)
            if with_state and keys.optimizer is not None:
                states.append((piece, _piece_state(keys, param.name, param.shape, piece, reads, directory)))
    for part in view.frozen():
        reads.run(keys.model + part.name, part.shape, part.begin, part.values)
    for name, buffer in view.buffers():
        reads.run(keys.model + name, tuple(buffer.shape), 0, buffer)
    if with_state and keys.optimizer is not None:
        for group in keys.groups().values():
            for key in group.values():
                reads.whole(key, keys.metadata.state_dict_metadata[key])
    return reads, states


def _piece_state(keys: DcpKeys, name: str, shape: tuple[int, ...], piece: PieceView, reads: Reads,
                 directory: Path) -> dict[str, Any]:
    """Buffers for a piece's saved state, asked for in `reads`: per-element tensors (the parameter's shape) by
    runs, scalars whole, other values as objects."""
    state: dict[str, Any] = {}
    for state_name, saved in keys.state_of(name).items():
        key = f"{keys.optimizer}state.{name}.{state_name}"
        if isinstance(saved, TensorStorageMetadata) and tuple(saved.size) == shape and shape:
            state[state_name] = torch.empty(piece.values.shape, dtype=saved.properties.dtype,
                                            device=piece.key.device)
            reads.run(key, shape, piece.begin, state[state_name])
        elif isinstance(saved, BytesStorageMetadata) or len(saved.size) == 0:
            reads.whole(key, saved)
            state[state_name] = key  # what was read for it, once read (every piece of the parameter shares it)
        else:
            raise ValueError(f"{directory}: optimizer state {key!r} has shape {tuple(saved.size)}, neither the "
                             f"parameter's {shape} nor a scalar: it cannot be cut into this rank's pieces")
    return state


def check_optimizer(engine: Checkpointed, keys: DcpKeys, description: Manifest | None, directory: Path) -> None:
    """The saved optimizer is of this engine's kind: by class where zerokit saved it, else by its hyperparameters'
    names (SGD's momentum is not Adam's betas), and with as many param groups."""
    optimizer = engine.view.optimizers[0]
    here = type(optimizer).__name__
    if description is not None and description.optimizers and description.optimizers[0]["class"] != here:
        raise ValueError(f"{directory}: saved with {description.optimizers[0]['class']}, this engine steps {here}")
    groups = keys.groups()
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{directory}: the saved optimizer has {len(groups)} param groups, this {here} has "
                         f"{len(optimizer.param_groups)}")
    for index, saved in groups.items():
        unknown = sorted(set(saved) - set(optimizer.param_groups[index]) - {"params"})
        if unknown:
            raise ValueError(f"{directory}: saved by an optimizer with hyperparameter {unknown[0]!r}, which this "
                             f"{here} does not have: not the same kind of optimizer")


def load_runs(reads: Reads, directory: Path, group: Any, weights_only: bool) -> None:
    """DCP reads every box into its place, and the objects (over `group`: its collectives match every rank's)."""
    dcp_load({}, storage_reader=FileSystemReader(directory), planner=RunsLoadPlanner(reads, weights_only),
             process_group=group, no_dist=group is None)


def install_state(states: list[tuple[PieceView, dict[str, Any]]], reads: Reads) -> None:
    """Each piece's optimizer state, as read."""
    for piece, state in states:
        state = {name: _own(reads.loaded[value]) if isinstance(value, str) else value for name, value in state.items()}
        piece.optimizer.state.pop(piece.key, None)
        if state:
            piece.optimizer.state[piece.key] = state


def _own(value: Any) -> Any:
    """A piece's own copy of a value read once for the parameter (a 0-dim step is updated in place by the step)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def install_groups(engine: Checkpointed, keys: DcpKeys, reads: Reads) -> None:
    """The saved hyperparameters into the engine's param groups (an LR schedule's changes come with them)."""
    optimizer = engine.view.optimizers[0]
    for index, saved in keys.groups().items():
        group = optimizer.param_groups[index]
        for name, key in saved.items():
            if name == "params":
                continue
            value, current = reads.loaded[key], group.get(name)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                group[name] = tuple(value) if isinstance(current, tuple) else value


def restore_dcp_rng(engine: Checkpointed, directory: Path, description: Manifest) -> None:
    """This rank's generators, where the saving run had this rank."""
    path = directory / rng_file(engine.rank)
    if engine.rank < description.world_size and path.is_file():
        tensors, meta = torch.load(path, weights_only=True)
        restore_rng(tensors, meta)
