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
the output dtype; a Hugging Face directory leaves the tied names out, as transformers does. One difference:
a stage-1 checkpoint keeps its frozen parameters only in the model's state dict, which zero_to_fp32 leaves
out; they are written here, so the output loads into the model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from zerokit.checkpoint.deepspeed_import import DeepSpeedCheckpoint, is_deepspeed_checkpoint, read_deepspeed_checkpoint
from zerokit.checkpoint.files import Readers, TensorSpec, write_file
from zerokit.checkpoint.hf_layout import CONFIG, DEFAULT_MAX_SHARD_BYTES, hf_config_text, kept_name, write_directory
from zerokit.checkpoint.locate import checkpoint_directory, saved_parts
from zerokit.checkpoint.relayout import CutReaders, open_whole
from zerokit.checkpoint.manifest import (MANIFEST, MASTER, Manifest, ParamRecord, dtype_of, rank_file, read_manifest,
                                         values_key)

PIECE_BYTES = 4 << 20
OUTPUT_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                 "fp16": torch.float16, "float16": torch.float16}
HF, SAFETENSORS = "hf", "safetensors"  # the output formats: a Hugging Face directory, one .safetensors file


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
    is_param: bool  # a parameter (an index counts them), not a buffer


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, tag: str | None = None,
                dtype: str = "fp32", trainable_only: bool = False,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, output_format: str | None = None) -> Consolidated:
    """Write the full state dict of `checkpoint` (a save_dir with `latest`, one checkpoint's directory, or the
    directory a pipeline's stages or a tensor group's ranks saved their parts under, read as one whole model: See
    relayout.py, which holds one whole parameter at a time) to `out`, in `output_format` (default: "safetensors"
    where out ends in .safetensors, else "hf"): "safetensors", one file with every key of the model's state_dict,
    tied ones included; "hf", a Hugging Face directory as engine.save_pretrained writes it (model.safetensors, or
    shards of at most max_shard_bytes with model.safetensors.index.json; tied weights once: See [Note: tied weights
    are written once] in hf_layout.py; config.json when the model was a transformers model). Floating tensors in
    `dtype` (fp32: the masters exactly). trainable_only: only trainable parameters."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not accepted; use fp32 or bf16 (or fp16)")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    output_format = _output_format(Path(out), output_format)
    started = time.perf_counter()
    if is_deepspeed_checkpoint(checkpoint, tag) and not (Path(checkpoint) / MANIFEST).is_file():
        return _consolidate_deepspeed(read_deepspeed_checkpoint(checkpoint, tag), Path(out), OUTPUT_DTYPES[dtype],
                                      trainable_only, max_shard_bytes, output_format, started)
    manifest, readers = _open(Path(checkpoint), tag)
    items, skipped = _items(manifest, OUTPUT_DTYPES[dtype], trainable_only, once=output_format == HF)
    out = Path(out)
    try:
        if output_format == SAFETENSORS:
            files = [_write_file(out, items, lambda path, written: _write(path, written, readers))]
        else:
            config = _config_file(manifest, OUTPUT_DTYPES[dtype]) if not trainable_only else {}
            files = write_directory(out, items, max_shard_bytes, lambda path, shard: _write(path, shard, readers),
                                    sum(item.spec.numel for item in items if item.is_param), config)
    finally:
        readers.close()
    return Consolidated(files, len(items), sum(item.spec.nbytes for item in items), time.perf_counter() - started,
                        skipped)


def _output_format(out: Path, output_format: str | None) -> str:
    if output_format is None:
        return SAFETENSORS if out.suffix == ".safetensors" else HF
    if output_format not in (HF, SAFETENSORS):
        raise ValueError(f"output format {output_format!r} is not known; use hf (a Hugging Face directory) or "
                         "safetensors (one file)")
    if output_format == HF and out.suffix == ".safetensors":
        raise ValueError(f"{out}: the hf format writes a directory, and this name ends in .safetensors; name a "
                         "directory, or ask for the safetensors format (one file)")
    return output_format


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


def _items(manifest: Manifest, dtype: torch.dtype, trainable_only: bool,
           once: bool = False) -> tuple[list[_Item], list[str]]:
    """What to write, in state-dict order; once: each tied tensor under one of its names only."""
    names_of: dict[str, list[str]] = {}
    for key, name, _ in manifest.model["state_dict"]:
        names_of.setdefault(name, []).append(key)
    kept = {kept_name(keys, ()) for keys in names_of.values()}  # no alias declarations in a manifest
    items, skipped = [], []
    for key, name, kind in manifest.model["state_dict"]:
        record = manifest.params[name]
        if once and key not in kept:
            continue
        if trainable_only and record.role != MASTER:
            skipped.append(key)
            continue
        saved = dtype_of(record.dtype)
        out_dtype = dtype if saved.is_floating_point else saved
        items.append(_Item(TensorSpec(key, out_dtype, tuple(record.shape)), name, record, kind == "param"))
    return items, skipped


def _config_file(manifest: Manifest, dtype: torch.dtype) -> dict[str, str]:
    hf_config = manifest.model.get("hf_config")
    return {CONFIG: hf_config_text(dict(hf_config), manifest.model["class"], dtype)} if hf_config else {}


def _pieces(item: _Item, readers: Readers) -> Iterator[torch.Tensor]:
    """The item's elements in order, PIECE_BYTES at a time, in the output dtype."""
    record, key = item.record, values_key(item.name, item.record.role)
    step = max(1, PIECE_BYTES // 4)
    for rank, begin, end in record.parts:
        reader = readers(rank_file(rank))
        for first in range(0, end - begin, step):
            yield reader.read_elements(key, first, min(first + step, end - begin)).to(item.spec.dtype)


def _write(path: Path, items: list[_Item], readers: Readers) -> None:
    write_file(path, [item.spec for item in items], (_pieces(item, readers) for item in items), {"format": "pt"})


def _write_file(path: Path, items: list, write: Callable[[Path, list], None]) -> Path:
    """One safetensors file at `path`, written under a temporary name and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    try:
        write(temporary, items)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)
    return path


@dataclass(frozen=True)
class _Whole:
    """A tensor of a DeepSpeed checkpoint, already whole in memory (See [Note: consolidating a DeepSpeed
    checkpoint])."""

    spec: TensorSpec
    tensor: torch.Tensor
    is_param: bool


def _consolidate_deepspeed(checkpoint: DeepSpeedCheckpoint, out: Path, dtype: torch.dtype, trainable_only: bool,
                           max_shard_bytes: int, output_format: str, started: float) -> Consolidated:
    state = checkpoint.state_dict()
    trainable = set(checkpoint.params) | {alias for alias, source in checkpoint.shared.items()
                                          if source in checkpoint.params}
    skipped = [key for key in state if trainable_only and key not in trainable]
    items = []
    for key, tensor in state.items():
        if key not in skipped and not (output_format == HF and key in checkpoint.shared):  # a tie's alias: once
            out_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            items.append(_Whole(TensorSpec(key, out_dtype, tuple(tensor.shape)), tensor, key not in checkpoint.buffers))
    if output_format == SAFETENSORS:
        files = [_write_file(out, items, _write_whole)]
    else:
        files = write_directory(out, items, max_shard_bytes, _write_whole,
                                sum(item.spec.numel for item in items if item.is_param))
    return Consolidated(files, len(items), sum(item.spec.nbytes for item in items), time.perf_counter() - started,
                        skipped)


def _write_whole(path: Path, items: list[_Whole]) -> None:
    write_file(path, [item.spec for item in items],
               ([item.tensor.contiguous().view(-1).to(item.spec.dtype)] for item in items), {"format": "pt"})
