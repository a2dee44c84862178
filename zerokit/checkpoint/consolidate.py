"""Offline consolidation: a checkpoint's full state dict as one safetensors file or a Hugging Face model
directory, with no process group and no GPU.

[Note: consolidation streams]
A consolidated tensor is the concatenation, in element order, of the parts the manifest lists for it
(See [Note: a checkpoint is per parameter, not per rank] in manifest.py), and a safetensors header
needs only each tensor's dtype and shape, which the manifest has. So the header is written first and
every tensor is then copied part by part, in pieces of at most PIECE_BYTES, converted to the output
dtype on the way: nothing the size of a tensor, let alone the model, is ever held. (DeepSpeed's
zero_to_fp32 loads every rank's optimizer file whole first.) The peak is a few pieces and the reader's
checked chunks, whatever the model's size.

[Note: consolidating a DeepSpeed checkpoint]
A DeepSpeed ZeRO checkpoint directory (no manifest.json, DeepSpeed's rank files) is read whole by
deepspeed_import.py, as DeepSpeed's zero_to_fp32 reads it, and written as zero_to_fp32 writes it: its
state dict (buffers, frozen parameters, fp32 masters, tied names as copies of the name they share) in
the output dtype. One difference: a stage-1 checkpoint keeps its frozen parameters only in the model's
state dict, which zero_to_fp32 leaves out; they are written here, so the output loads into the model.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from zerokit.checkpoint.deepspeed_import import DeepSpeedCheckpoint, is_deepspeed_checkpoint, read_deepspeed_checkpoint
from zerokit.checkpoint.files import Readers, TensorSpec, fsync_dir, write_file
from zerokit.checkpoint.locate import checkpoint_directory, saved_parts
from zerokit.checkpoint.relayout import CutReaders, open_whole
from zerokit.checkpoint.manifest import (MANIFEST, MASTER, Manifest, ParamRecord, dtype_of, rank_file, read_manifest,
                                         values_key)

PIECE_BYTES = 4 << 20
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default (5GB)
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
OUTPUT_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                 "fp16": torch.float16, "float16": torch.float16}


@dataclass
class Consolidated:
    """What consolidate() wrote."""

    files: list[Path]
    tensors: int
    bytes: int
    seconds: float
    skipped: list[str] = field(default_factory=list)  # keys left out (--trainable-only)


@dataclass(frozen=True)
class _Item:
    spec: TensorSpec  # as written: the state-dict key, the output dtype, the shape
    name: str  # the parameter or buffer whose values these are (a tied key names the first)
    record: ParamRecord


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, tag: str | None = None,
                dtype: str = "fp32", trainable_only: bool = False,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Consolidated:
    """Write the full state dict of `checkpoint` (a save_dir with `latest`, one checkpoint's directory, or the
    directory a pipeline's stages or a tensor group's ranks saved their parts under, read as one whole model: See
    relayout.py, which holds one whole parameter at a time) to `out`: one file if it ends in .safetensors, else a
    Hugging Face directory (model.safetensors, or shards of at most max_shard_bytes with model.safetensors.index.json,
    and config.json when the model was a transformers model). Floating tensors in `dtype` (fp32: the masters exactly);
    keys as the model's state_dict has them, tied ones included. trainable_only: only trainable parameters."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not accepted; use fp32 or bf16 (or fp16)")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    started = time.perf_counter()
    if is_deepspeed_checkpoint(checkpoint, tag) and not (Path(checkpoint) / MANIFEST).is_file():
        return _consolidate_deepspeed(read_deepspeed_checkpoint(checkpoint, tag), Path(out), OUTPUT_DTYPES[dtype],
                                      trainable_only, max_shard_bytes, started)
    manifest, readers = _open(Path(checkpoint), tag)
    items, skipped = _items(manifest, OUTPUT_DTYPES[dtype], trainable_only)
    out = Path(out)
    try:
        if out.suffix == ".safetensors":
            out.parent.mkdir(parents=True, exist_ok=True)
            files = [_write(out, items, readers)]
        else:
            files = _write_directory(out, items, readers, manifest, OUTPUT_DTYPES[dtype], trainable_only,
                                     max_shard_bytes)
    finally:
        readers.close()
    return Consolidated(files, len(items), sum(item.spec.nbytes for item in items), time.perf_counter() - started,
                        skipped)


def _open(checkpoint: Path, tag: str | None) -> tuple[Manifest, "Readers | CutReaders"]:
    """The manifest and readers of a checkpoint, or of the parts a pipeline or tensor-parallel layout saved under
    `checkpoint`, read as one whole model (See [Note: a checkpoint per stage and tensor rank, read as one] in
    relayout.py)."""
    parts = saved_parts(checkpoint)
    if parts and parts != [checkpoint]:
        source = open_whole(parts, tag)
        return source.manifest, source.readers
    directory = checkpoint_directory(checkpoint, tag)
    manifest = read_manifest(directory)
    return manifest, Readers(directory, manifest.files)


def _items(manifest: Manifest, dtype: torch.dtype, trainable_only: bool) -> tuple[list[_Item], list[str]]:
    items, skipped = [], []
    for key, name, _ in manifest.model["state_dict"]:
        record = manifest.params[name]
        if trainable_only and record.role != MASTER:
            skipped.append(key)
            continue
        saved = dtype_of(record.dtype)
        out_dtype = dtype if saved.is_floating_point else saved
        items.append(_Item(TensorSpec(key, out_dtype, tuple(record.shape)), name, record))
    return items, skipped


def _pieces(item: _Item, readers: Readers) -> Iterator[torch.Tensor]:
    """The item's elements in order, PIECE_BYTES at a time, in the output dtype."""
    record, key = item.record, values_key(item.name, item.record.role)
    step = max(1, PIECE_BYTES // 4)
    for rank, begin, end in record.parts:
        reader = readers(rank_file(rank))
        for first in range(0, end - begin, step):
            yield reader.read_elements(key, first, min(first + step, end - begin)).to(item.spec.dtype)


def _write(path: Path, items: list[_Item], readers: Readers) -> Path:
    temporary = path.with_name(path.name + ".tmp")
    write_file(temporary, [item.spec for item in items], (_pieces(item, readers) for item in items), {"format": "pt"})
    os.replace(temporary, path)
    return path


def shard_plan(items: list[_Item], max_shard_bytes: int) -> list[list[_Item]]:
    """Consecutive tensors, each shard under max_shard_bytes (a larger tensor is a shard of its own)."""
    shards: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.spec.nbytes
    return shards


def _write_directory(out: Path, items: list[_Item], readers: Readers, manifest: Manifest, dtype: torch.dtype,
                     trainable_only: bool, max_shard_bytes: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_plan(items, max_shard_bytes)
    if len(shards) == 1:
        files = [_write(out / SINGLE, shards[0], readers)]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        files = [_write(out / name, shard, readers) for name, shard in zip(names, shards)]
        index = {"metadata": {"total_size": sum(item.spec.nbytes for item in items)},
                 "weight_map": {item.spec.key: name for name, shard in zip(names, shards) for item in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
        files.append(out / INDEX)
    hf_config = manifest.model.get("hf_config")
    if hf_config and not trainable_only:
        files.append(_write_hf_config(out, dict(hf_config), manifest.model["class"], dtype))
    fsync_dir(out)
    return files


def _write_hf_config(out: Path, config: dict, model_class: str, dtype: torch.dtype) -> Path:
    """transformers' config.json, saying which dtype the weights are in."""
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    if "dtype" not in config and "torch_dtype" not in config:
        config["torch_dtype"] = name
    if not config.get("architectures"):
        config["architectures"] = [model_class]
    path = out / "config.json"
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


@dataclass(frozen=True)
class _Whole:
    """A tensor of a DeepSpeed checkpoint, already whole in memory (See [Note: consolidating a DeepSpeed
    checkpoint])."""

    spec: TensorSpec
    tensor: torch.Tensor


def _consolidate_deepspeed(checkpoint: DeepSpeedCheckpoint, out: Path, dtype: torch.dtype, trainable_only: bool,
                           max_shard_bytes: int, started: float) -> Consolidated:
    state = checkpoint.state_dict()
    trainable = set(checkpoint.params) | {alias for alias, source in checkpoint.shared.items()
                                          if source in checkpoint.params}
    skipped = [key for key in state if trainable_only and key not in trainable]
    items = []
    for key, tensor in state.items():
        if key not in skipped:
            out_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            items.append(_Whole(TensorSpec(key, out_dtype, tuple(tensor.shape)), tensor))
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        files = [_write_whole(out, items)]
    else:
        out.mkdir(parents=True, exist_ok=True)
        shards = shard_plan(items, max_shard_bytes)
        if len(shards) == 1:
            files = [_write_whole(out / SINGLE, shards[0])]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            files = [_write_whole(out / name, shard) for name, shard in zip(names, shards)]
            index = {"metadata": {"total_size": sum(item.spec.nbytes for item in items)},
                     "weight_map": {item.spec.key: name for name, shard in zip(names, shards) for item in shard}}
            (out / INDEX).write_text(json.dumps(index, indent=2))
            files.append(out / INDEX)
        fsync_dir(out)
    return Consolidated(files, len(items), sum(item.spec.nbytes for item in items), time.perf_counter() - started,
                        skipped)


def _write_whole(path: Path, items: list[_Whole]) -> Path:
    temporary = path.with_name(path.name + ".tmp")
    write_file(temporary, [item.spec for item in items],
               ([item.tensor.contiguous().view(-1).to(item.spec.dtype)] for item in items), {"format": "pt"})
    os.replace(temporary, path)
    return path
