"""Loading a manifest's parameters into an engine of any world size and stage: each optimizer piece
reads the element ranges it covers from whichever rank files hold them, and nothing else. See [Note: a
checkpoint is per parameter, not per rank] in manifest.py."""

from __future__ import annotations

from pathlib import Path
import torch
from torch import nn

from zerokit.checkpoint.files import Readers
from zerokit.checkpoint.manifest import MANIFEST, MASTER, Manifest, ParamRecord, rank_file, state_key, values_key
from zerokit.checkpoint.optimizer_state import decode_scalar
from zerokit.stages.view import ParameterView, PieceView, persistent_buffers


def read_range(readers: Readers, record: ParamRecord, key: str, begin: int, out: torch.Tensor) -> None:
    """Elements [begin, begin + out.numel()) of a saved parameter (flattened) into `out` (any dtype and
    device: cast and moved as needed), read from every part that overlaps them."""
    end = begin + out.numel()
    flat = out.view(-1)
    for rank, part_begin, part_end in record.parts:
        first, last = max(begin, part_begin), min(end, part_end)
        if first >= last:
            continue
        target = flat[first - begin:last - begin]
        reader = readers(rank_file(rank))
        if target.device.type == "cpu" and target.dtype == reader.spec(key).dtype and target.is_contiguous():
            reader.read_into(key, first - part_begin, target)
        else:
            target.copy_(reader.read_elements(key, first - part_begin, last - part_begin))


def check_model(manifest: Manifest, module: nn.Module, directory: Path) -> None:
    """The checkpoint is of this model: the same state-dict keys, each parameter and buffer of the same shape."""
    where = directory / MANIFEST
    saved_keys = [key for key, _, _ in manifest.model["state_dict"]]
    keys = [key for key, value in module.state_dict(keep_vars=True).items() if isinstance(value, torch.Tensor)]
    missing = [key for key in keys if key not in set(saved_keys)]
    extra = [key for key in saved_keys if key not in set(keys)]
    if missing or extra:
        what = f"has no {missing[0]!r}" if missing else f"has {extra[0]!r}, which this model lacks"
        raise ValueError(f"{where}: from another model ({manifest.model['class']}): it {what}")
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    shapes.update({name: tuple(b.shape) for name, b in persistent_buffers(module)})
    for name, shape in shapes.items():
        record = manifest.params.get(name)
        if record is None:
            raise ValueError(f"{where}: from another model ({manifest.model['class']}): no values for {name!r}")
        if tuple(record.shape) != shape:
            raise ValueError(f"{where}: from another model ({manifest.model['class']}): {name!r} has shape "
                             f"{tuple(record.shape)} there, {shape} here")


def restore_trainable(view: ParameterView, manifest: Manifest, readers: Readers, directory: Path,
                      with_state: bool) -> None:
    """Masters (and optimizer state) of every piece this rank steps."""
    for param in view.trainable():
        record = manifest.params[param.name]
        for piece in param.pieces:
            with torch.no_grad():
                read_range(readers, record, values_key(param.name, record.role), piece.begin, piece.values)
            if not with_state:
                continue
            if record.role == MASTER:
                _check_optimizer(manifest, record, param.name, piece, directory)
            _restore_piece_state(piece, record, param.name, readers)


def _check_optimizer(manifest: Manifest, record: ParamRecord, name: str, piece: PieceView, directory: Path) -> None:
    saved = manifest.optimizers[record.optimizer]["class"] if record.optimizer is not None else None
    here = type(piece.optimizer).__name__
    if (record.optimizer, record.group, saved) != (piece.optimizer_index, piece.group, here):
        raise ValueError(f"{directory / MANIFEST}: {name!r} was stepped by {saved} (optimizer {record.optimizer}, "
                         f"param group {record.group}) there, by {here} (optimizer {piece.optimizer_index}, group "
                         f"{piece.group}) here")


def _restore_piece_state(piece: PieceView, record: ParamRecord, name: str, readers: Readers) -> None:
    """The piece's optimizer state from the saved one; a parameter never stepped (or frozen when saved) has none."""
    key, state = piece.key, {}
    if record.role == MASTER and (record.state or record.scalars):
        for scalar, encoded in record.scalars.items():
            state[scalar] = decode_scalar(encoded, key.device)
        rank = record.parts[0][0]
        for name_of_state in record.state:
            saved = state_key(name_of_state, name)
            if record.whole_tensor:
                state[name_of_state] = readers(rank_file(rank)).read_tensor(saved).to(key.device)
            else:
                values = torch.empty(key.shape, dtype=readers(rank_file(rank)).spec(saved).dtype, device=key.device)
                read_range(readers, record, saved, piece.begin, values)
                state[name_of_state] = values
    piece.optimizer.state.pop(key, None)
    if state:
        piece.optimizer.state[key] = state


def restore_frozen(view: ParameterView, manifest: Manifest, readers: Readers) -> None:
    """Frozen parameters: whole where the engine holds them whole, this rank's shard of each at stage 3."""
    with torch.no_grad():
        for part in view.frozen():
            record = manifest.params[part.name]
            read_range(readers, record, values_key(part.name, record.role), part.begin, part.values)


def restore_buffers(view: ParameterView, manifest: Manifest, readers: Readers) -> None:
    with torch.no_grad():
        for name, buffer in view.buffers():
            record = manifest.params[name]
            read_range(readers, record, values_key(name, record.role), 0, buffer)
