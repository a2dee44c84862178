"""What one rank saves: its parts of every parameter (fp32 masters and optimizer state of what it steps;
frozen parameters where nothing else holds them), persistent buffers, and its RNG states, as tensors
for its rank file plus the records the manifest is built from. See [Note: a checkpoint is per
parameter, not per rank] in manifest.py.

Only `masters.piece_refs()`, each piece's `optimizer.state` and the layout's names are read, so a tier
that keeps the masters elsewhere (host memory, NVMe) is saved by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from zerokit.checkpoint.files import TensorSpec
from zerokit.checkpoint.manifest import BUFFER, FROZEN, MASTER, PartRecord, dtype_name, state_key, values_key
from zerokit.checkpoint.optimizer_state import split_piece_state
from zerokit.checkpoint.rng import capture_rng
from zerokit.flat import Slot, assign_owners
from zerokit.masters import PieceRef
from zerokit.masters.optimizer import WHOLE_TENSOR, optimizer_kind

if TYPE_CHECKING:
    from zerokit.engine import Engine


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


def optimizer_list(engine: "Engine") -> list[torch.optim.Optimizer]:
    optimizer = engine.optimizer
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def slots_by_index(engine: "Engine") -> dict[int, Slot]:
    """Trainable parameter index -> its layout slot: its state-dict name (a tied parameter's first), shape."""
    return {slot.param_index: slot for bucket in engine.stage.layout.buckets for slot in bucket.slots}


def collect(engine: "Engine") -> RankPayload:
    payload = RankPayload([], [], {})
    _trainable(engine, payload)
    _frozen(engine, payload)
    if engine.rank == 0:
        for name, buffer in persistent_buffers(engine.module):
            _whole(payload, name, BUFFER, buffer.detach(), engine.rank)
    rng_tensors, payload.rng = capture_rng()
    payload.entries += [SaveEntry(TensorSpec(key, t.dtype, tuple(t.shape)), [t]) for key, t in rng_tensors.items()]
    return payload


def replicated(engine: "Engine") -> bool:
    """Every rank holds every master (stage 0): each parameter is then written by one rank only."""
    return engine.stage.layout.world_size != engine.world_size


def _writers(sizes: list[int], world_size: int) -> list[int]:
    """Which rank writes each of a list of tensors every rank holds: spread by size (See assign_owners)."""
    return assign_owners(sizes, world_size)


def _trainable(engine: "Engine", payload: RankPayload) -> None:
    slots = slots_by_index(engine)
    by_param: dict[int, list[PieceRef]] = {}
    for ref in engine.stage.masters.piece_refs():
        by_param.setdefault(ref.param_index, []).append(ref)
    writers = None
    if replicated(engine):
        indices = sorted(by_param)
        sizes = [sum(ref.piece.numel() for ref in by_param[i]) for i in indices]
        writers = dict(zip(indices, _writers(sizes, engine.world_size)))
    optimizers = optimizer_list(engine)
    position = {id(o): i for i, o in enumerate(optimizers)}
    group_of = {id(p): g for o in optimizers for g, group in enumerate(o.param_groups) for p in group["params"]}
    config = engine.config
    for param_index in sorted(by_param):
        if writers is not None and writers[param_index] != engine.rank:
            continue
        refs = sorted(by_param[param_index], key=lambda ref: ref.param_begin)
        optimizer = refs[0].optimizer
        whole = optimizer_kind(optimizer, config.optimizer_kinds, config.allow_untested_optimizer) == WHOLE_TENSOR
        _param_part(payload, slots[param_index], refs, engine.rank, position[id(optimizer)],
                    group_of[id(refs[0].piece)], whole)


def _param_part(payload: RankPayload, slot: Slot, refs: list[PieceRef], rank: int, optimizer: int, group: int,
                whole: bool) -> None:
    """One parameter's part on this rank: its pieces' masters back to back, and their optimizer state."""
    name = slot.name
    begin = refs[0].param_begin
    end = begin
    for ref in refs:
        if ref.param_begin != end:
            raise RuntimeError(f"rank {rank}: the pieces of {name!r} are not contiguous (an internal bug)")
        end += ref.piece.numel()
    states = [ref.optimizer.state.get(ref.piece) for ref in refs]
    if any(states) and not all(states):
        raise RuntimeError(f"rank {rank}: some pieces of {name!r} were stepped and others not (an internal bug)")
    split = [split_piece_state(state, ref.piece, whole, name) for state, ref in zip(states, refs) if state]
    scalars = split[0][1] if split else {}
    if any(other[1] != scalars or other[0].keys() != split[0][0].keys() for other in split):
        raise RuntimeError(f"rank {rank}: the pieces of {name!r} disagree on their optimizer scalars (an internal bug)")
    keys = tuple(split[0][0]) if split else ()
    shape = tuple(refs[0].piece.shape) if whole else (end - begin,)
    payload.entries.append(SaveEntry(TensorSpec(values_key(name, MASTER), torch.float32, shape),
                                     [ref.piece.detach() for ref in refs]))
    for key in keys:
        tensors = [tensors[key] for tensors, _ in split]
        if whole:
            spec = TensorSpec(state_key(key, name), tensors[0].dtype, tuple(tensors[0].shape))
        else:
            spec = TensorSpec(state_key(key, name), tensors[0].dtype, (end - begin,))
        payload.entries.append(SaveEntry(spec, tensors))
    payload.parts.append(PartRecord(name, MASTER, "float32", tuple(slot.shape), rank, begin, end, optimizer, group,
                                    whole, keys, scalars))


class FrozenPart(NamedTuple):
    """This rank's part of a frozen parameter sharded at stage 3."""

    name: str
    shape: tuple[int, ...]
    begin: int  # its first element within the parameter
    values: torch.Tensor  # the part, a view of the frozen shard


def frozen_parameters(engine: "Engine") -> tuple[list[tuple[str, nn.Parameter]], list[FrozenPart]]:
    """Frozen parameters as the engine holds them: the ones it keeps whole (stages 0-2, or not floating point),
    and at stage 3 this rank's parts of the sharded ones (See [Note: frozen parameters at stage 3])."""
    stage = engine.stage
    sharded = {id(p) for p in stage.frozen.flat.params} if engine.config.stage == 3 else set()
    held = {id(p) for p in stage.flat.params} | sharded
    whole = [(name, p) for name, p in engine.module.named_parameters() if id(p) not in held]
    parts = []
    if sharded:
        frozen = stage.frozen
        for bucket in frozen.layout.buckets:
            slots = {slot.param_index: slot for slot in bucket.slots}
            shard = frozen.shard(bucket)
            for part in bucket.param_slices(engine.rank):
                slot = slots[part.param_index]
                parts.append(FrozenPart(slot.name, slot.shape, part.param_begin, shard[part.begin:part.end]))
    return whole, parts


def _frozen(engine: "Engine", payload: RankPayload) -> None:
    """Frozen parameters: at stage 3 this rank's shard of each; whole ones are spread over the ranks to write."""
    whole, parts = frozen_parameters(engine)
    for (name, param), writer in zip(whole, _writers([p.numel() for _, p in whole], engine.world_size)):
        if writer == engine.rank:
            _whole(payload, name, FROZEN, param.detach(), engine.rank)
    for part in parts:
        values = part.values
        payload.entries.append(SaveEntry(TensorSpec(values_key(part.name, FROZEN), values.dtype, (values.numel(),)),
                                         [values]))
        payload.parts.append(PartRecord(part.name, FROZEN, dtype_name(values.dtype), part.shape, engine.rank,
                                        part.begin, part.begin + values.numel()))


def _whole(payload: RankPayload, name: str, role: str, tensor: torch.Tensor, rank: int) -> None:
    payload.entries.append(SaveEntry(TensorSpec(values_key(name, role), tensor.dtype, (tensor.numel(),)), [tensor]))
    payload.parts.append(PartRecord(name, role, dtype_name(tensor.dtype), tuple(tensor.shape), rank, 0, tensor.numel()))


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers the module's state_dict holds (not the non-persistent ones), by name."""
    keys = module.state_dict(keep_vars=True).keys()
    return [(name, buffer) for name, buffer in module.named_buffers() if name in keys]
