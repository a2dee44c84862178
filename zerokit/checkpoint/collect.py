"""What one rank saves: its parts of every parameter (fp32 masters and optimizer state of what it steps;
frozen parameters where nothing else holds them), persistent buffers, and its RNG states, as tensors
for its rank file plus the records the manifest is built from. See [Note: a checkpoint is per
parameter, not per rank] in manifest.py.

Only `masters.piece_refs()`, each piece's `optimizer.state` and the layout's names are read, so a tier
that keeps the masters elsewhere (host memory, NVMe) is saved by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerokit.checkpoint.files import TensorSpec
from zerokit.checkpoint.manifest import BUFFER, FROZEN, MASTER, PartRecord, dtype_name, state_key, values_key
from zerokit.checkpoint.optimizer_state import split_piece_state
from zerokit.checkpoint.rng import capture_rng
from zerokit.flat import assign_owners
from zerokit.stages.view import ParameterView, PlacedView, TrainableView
from zerokit.checkpoint.checkpointed import Checkpointed



@dataclass
class SaveEntry:
    """One tensor of a rank file, whose elements are those of `sources` back to back."""

    spec: TensorSpec
    sources: list[torch.Tensor]


@dataclass
class RankPayload:
    entries: list[SaveEntry]
    parts: list[PartRecord]
    rng: dict[str, Any]


def collect(engine: Checkpointed) -> RankPayload:
    view = engine.view
    payload = RankPayload([], [], {})
    for section in view.sections() if hasattr(view, "sections") else [view]:  # See SplitView in stages/view.py
        _trainable(section, payload, view.rank)
    _frozen(view, payload)
    if view.rank == 0:
        for name, buffer in view.buffers():
            _whole(payload, name, BUFFER, buffer.detach(), view.rank)
    rng_tensors, payload.rng = capture_rng()
    payload.entries += [SaveEntry(TensorSpec(key, t.dtype, tuple(t.shape)), [t]) for key, t in rng_tensors.items()]
    return payload


def _writers(sizes: list[int], world_size: int) -> list[int]:
    """Which rank writes each of a list of tensors every rank holds: spread by size (See assign_owners)."""
    return assign_owners(sizes, world_size)


def _trainable(view: ParameterView | PlacedView, payload: RankPayload, file_rank: int) -> None:
    """This rank's parts of the view's trainable parameters, in the rank file `file_rank` (the view's rank and world
    are its own group's: a split experts' stage writes over its expert-data group)."""
    if not view.writes_shards:  # a MiCS replica: replica 0 saves the same shards
        return
    params = view.trainable()
    writers = None
    if view.replicated:  # every rank holds every master: each is written by one
        writers = _writers([sum(piece.values.numel() for piece in param.pieces) for param in params], view.world_size)
    for index, param in enumerate(params):
        if writers is None or writers[index] == view.rank:
            _param_part(payload, param, file_rank)


def _param_part(payload: RankPayload, param: TrainableView, rank: int) -> None:
    """One parameter's part on this rank: its pieces' masters back to back, and their optimizer state."""
    name, pieces, whole = param.name, param.pieces, param.whole_tensor
    begin = pieces[0].begin
    end = begin
    for piece in pieces:
        if piece.begin != end:
            raise RuntimeError(f"rank {rank}: the pieces of {name!r} are not contiguous (an internal bug)")
        end += piece.values.numel()
    states = [piece.optimizer.state.get(piece.key) for piece in pieces]
    if any(states) and not all(states):
        raise RuntimeError(f"rank {rank}: some pieces of {name!r} were stepped and others not (an internal bug)")
    split = [split_piece_state(state, piece.key, whole, name) for state, piece in zip(states, pieces) if state]
    scalars = split[0][1] if split else {}
    if any(other[1] != scalars or other[0].keys() != split[0][0].keys() for other in split):
        raise RuntimeError(f"rank {rank}: the pieces of {name!r} disagree on their optimizer scalars (an internal bug)")
    keys = tuple(split[0][0]) if split else ()
    shape = tuple(pieces[0].values.shape) if whole else (end - begin,)
    payload.entries.append(SaveEntry(TensorSpec(values_key(name, MASTER), torch.float32, shape),
                                     [piece.values.detach() for piece in pieces]))
    for key in keys:
        tensors = [tensors[key] for tensors, _ in split]
        if whole:
            spec = TensorSpec(state_key(key, name), tensors[0].dtype, tuple(tensors[0].shape))
        else:
            spec = TensorSpec(state_key(key, name), tensors[0].dtype, (end - begin,))
        payload.entries.append(SaveEntry(spec, tensors))
    first = pieces[0]
    payload.parts.append(PartRecord(name, MASTER, "float32", tuple(param.shape), rank, begin, end,
                                    first.optimizer_index, first.group, whole, keys, scalars))


def _frozen(view: ParameterView, payload: RankPayload) -> None:
    """Frozen parameters: at stage 3 this rank's shard of each; whole ones are spread over the ranks to write."""
    frozen = view.frozen()
    whole = [part for part in frozen if part.whole]
    for part, writer in zip(whole, _writers([part.values.numel() for part in whole], view.world_size)):
        if writer == view.rank:
            _whole(payload, part.name, FROZEN, part.values.detach(), view.rank)
    for part in frozen:
        if part.whole or not view.writes_shards:
            continue
        values = part.values
        payload.entries.append(SaveEntry(TensorSpec(values_key(part.name, FROZEN), values.dtype, (values.numel(),)),
                                         [values]))
        payload.parts.append(PartRecord(part.name, FROZEN, dtype_name(values.dtype), part.shape, view.rank,
                                        part.begin, part.begin + values.numel()))


def _whole(payload: RankPayload, name: str, role: str, tensor: torch.Tensor, rank: int) -> None:
    payload.entries.append(SaveEntry(TensorSpec(values_key(name, role), tensor.dtype, (tensor.numel(),)), [tensor]))
    payload.parts.append(PartRecord(name, role, dtype_name(tensor.dtype), tuple(tensor.shape), rank, 0, tensor.numel()))
