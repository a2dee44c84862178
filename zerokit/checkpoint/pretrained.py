"""Hugging Face model files out of a running engine and into one: engine.save_pretrained writes the directory that
transformers' from_pretrained loads, engine.load_pretrained reads such a directory into an engine of any stage and
world size, and the drop-in's save_16bit_model writes one weights file the same way. Every rank calls them.

[Note: save_pretrained streams]
A safetensors header needs only each tensor's key, dtype and shape, and every rank knows those before anything is
gathered (a released stage-3 parameter keeps its full shape). So the tensors are listed first, in the order saving
gathers them (ParameterView.gather_groups: one unit at a time at stage 3, all at once below it, where parameters
are whole anyway), then buffers; the list is cut into shards by size, and each file's header is written before its
first tensor is gathered. Then every rank goes through the groups, gathering each in turn, and rank 0 appends each
tensor's bytes to its file while its group is gathered, before the next group is, straight from the gathered memory
(a tensor of another output dtype: its cast copy): rank 0 holds one gathered group (and one cast tensor) at a time,
whatever the model's size, where full_state_dict() (what a caller
of transformers' save_pretrained must build) holds the whole model in fp32. The values are the engine's compute
parameters: full_state_dict() before its cast to fp32, so the two agree to the bit in any dtype. Rank 0 alone
writes; if it fails (a full disk), it still goes through the remaining groups, so that the other ranks' gathers are
matched, then the ranks exchange errors (one small collective of the checkpoint group: See session.py) and every
rank raises. Files are published as [Note: a model directory is published, not written] in hf_layout.py says.

[Note: load_pretrained reads only what a rank holds]
A Hugging Face directory (model.safetensors, or shards named by model.safetensors.index.json) is read as a
checkpoint load reads a zerokit checkpoint (See restore.py): each rank fills only the optimizer pieces it steps
(fp32 masters), its part of each frozen parameter and the buffers, reading each file in turn with safetensors'
safe_open and, of each tensor, only the rows that hold the element range it needs (get_slice), then
view.after_load() makes the masters the model's parameters on every rank; the optimizer state is left as it is.
Keys are checked first, on every rank, before anything is read: a tie's alias may be absent (transformers writes
each tied tensor once), any other parameter or persistent buffer of the model missing from the files, or a key of
the files that the model lacks, is an error naming the first of each, and nothing is loaded. Read errors are
exchanged before anything is published, as [Note: a load fails on every rank or on none] in load.py says.
"""

from __future__ import annotations

import json
import math
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from zerokit.checkpoint.checkpointed import Checkpointed
from zerokit.checkpoint.consolidate import OUTPUT_DTYPES
from zerokit.checkpoint.files import TensorSpec, write_file
from zerokit.checkpoint.hf_layout import (CONFIG, INDEX, SINGLE, declared_aliases, hf_config_text, kept_name,
                                          write_directory)
from zerokit.checkpoint.load import raise_first, ranked
from zerokit.checkpoint.session import session_of
from zerokit.stages.view import ParameterView, persistent_buffers

GENERATION_CONFIG = "generation_config.json"
Result = TypeVar("Result")


@dataclass(frozen=True)
class Written:
    """One tensor to write: its header entry and where its values are."""

    spec: TensorSpec  # the state-dict key it is written under, the output dtype, the full shape
    tensor: torch.Tensor  # the parameter (whole only while its group is gathered) or buffer
    is_param: bool
    aliases: tuple[str, ...] = ()  # its other state-dict names (a tie's), left out of safetensors files


def output_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """save_pretrained's `dtype`: a torch dtype or its name (bf16, float16, ...); None: as the engine computes."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not accepted; use torch.float32, torch.bfloat16 or torch.float16 (or "
                         "fp32, bf16, fp16)")
    return OUTPUT_DTYPES[name]


def save_pretrained(engine: Checkpointed, save_directory: str | Path, max_shard_bytes: int,
                    dtype: torch.dtype | None) -> list[Path]:
    """What engine.save_pretrained does (See [Note: save_pretrained streams]); returns the files written (on
    rank 0; [] on the others)."""
    items, values = _planned(engine, "save_pretrained", dtype, exclude_frozen=False)
    compute = next((p.dtype for p in engine.module.parameters() if p.is_floating_point()), torch.float32)
    other_files = _config_files(engine.module, dtype or compute)
    total_parameters = sum(item.spec.numel for item in items if item.is_param)

    def write() -> list[Path]:
        return write_directory(Path(save_directory), items, max_shard_bytes,
                               lambda path, shard: _write_shard(path, shard, values), total_parameters, other_files)

    return _written_by_rank0(engine, write, values, Path(save_directory)) or []


def save_weights_file(engine: Checkpointed, path: Path, dtype: torch.dtype | None, exclude_frozen: bool) -> Path | None:
    """One safetensors file of the model's weights at `path`, streamed as save_pretrained's (tied weights once);
    returns it on rank 0."""
    items, values = _planned(engine, "save_16bit_model", dtype, exclude_frozen)

    def write() -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return _write_one_file(path, items, values)

    return _written_by_rank0(engine, write, values, path)


def _planned(engine: Checkpointed, call: str, dtype: torch.dtype | None,
             exclude_frozen: bool) -> tuple[list[Written], Iterator[torch.Tensor]]:
    """The tensors to write, in order, and the stream of their values (nothing gathered until it is read)."""
    _refuse_layouts(engine, call)
    session_of(engine).writer.wait()  # an asynchronous save uses the checkpoint group from its own thread
    groups, buffers = write_plan(engine.view, engine.module, dtype, exclude_frozen, not_saved(engine.module))
    return [item for group in groups for item in group] + buffers, _values(engine.view, groups, buffers)


def not_saved(module: nn.Module) -> frozenset[str]:
    """The keys a transformers model asks save_pretrained to leave out (its _keys_to_ignore_on_save)."""
    return frozenset(getattr(module, "_keys_to_ignore_on_save", None) or ())


def gathered_state_dict(view: ParameterView, module: nn.Module, dtype: torch.dtype | None, exclude_frozen: bool,
                        keep: bool) -> dict[str, torch.Tensor]:
    """The model's state dict on CPU in `dtype` (None: as the engine computes), every key of it, a tie's names
    sharing one tensor, gathered group by group (no fp32 copy of the model). keep=False: go through the gathers
    (every rank must) and return {} (DeepSpeed fills it on rank 0 only)."""
    if not keep:
        for _ in view.gathered_in_turn():
            pass
        return {}
    groups, buffers = write_plan(view, module, dtype, exclude_frozen)
    state: dict[str, torch.Tensor] = {}
    with closing(_values(view, groups, buffers)) as values:
        for item, value in zip([item for group in groups for item in group] + buffers, values, strict=True):
            value = _kept(item, value)
            state[item.spec.key] = value
            state.update({alias: value for alias in item.aliases})
    return {key: state[key] for key in module.state_dict(keep_vars=True) if key in state}  # the state dict's order


def write_plan(view: ParameterView, module: nn.Module, dtype: torch.dtype | None, exclude_frozen: bool = False,
               left_out: frozenset[str] = frozenset()) -> tuple[list[list[Written]], list[Written]]:
    """The tensors to write: the parameters of each gather group, in order, then the persistent buffers (held whole
    on every rank). Each tensor once, under the name [Note: tied weights are written once] in hf_layout.py picks;
    the keys `left_out` left out."""
    keys = set(module.state_dict(keep_vars=True)) - left_out
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in keys:
            names.setdefault(id(param), []).append(name)
    aliases = declared_aliases(module)
    groups = []
    for params in view.gather_groups():
        group = []
        for param in params:
            if id(param) not in names or (exclude_frozen and not param.requires_grad):
                continue
            key = kept_name(names[id(param)], aliases)
            spec = TensorSpec(key, _dtype_of(param, dtype), tuple(param.shape))
            group.append(Written(spec, param, True, tuple(name for name in names[id(param)] if name != key)))
        groups.append(group)
    buffers = [Written(TensorSpec(name, _dtype_of(buffer, dtype), tuple(buffer.shape)), buffer, False)
               for name, buffer in persistent_buffers(module) if name in keys]
    return groups, buffers


def _dtype_of(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _values(view: ParameterView, groups: list[list[Written]], buffers: list[Written]) -> Iterator[torch.Tensor]:
    """Each planned tensor's values on the CPU in its output dtype, in plan order, gathering group by group: a
    parameter's values are read while its group is gathered, before the next group is asked for."""
    with closing(view.gathered_in_turn()) as gathered:
        for _, group in zip(gathered, groups, strict=True):
            for item in group:
                yield _on_cpu(item)
    for item in buffers:
        yield _on_cpu(item)


def _kept(item: Written, value: torch.Tensor) -> torch.Tensor:
    """`value` as a state dict keeps it: a copy where it is the parameter's own memory, which stage 3 frees when it
    releases the parameter's group."""
    same = value.untyped_storage().data_ptr() == item.tensor.untyped_storage().data_ptr()
    return value.clone() if same else value


def _on_cpu(item: Written) -> torch.Tensor:
    """The tensor's values on the CPU in its output dtype: the parameter's own memory where it is already there in
    that dtype (the writer reads it without a copy and without numpy, so stage 3 can still free it: See
    tensor_bytes_view in files.py), else a converted copy."""
    return item.tensor.detach().to(device="cpu", dtype=item.spec.dtype)


def _write_shard(path: Path, shard: list[Written], values: Iterator[torch.Tensor]) -> None:
    """One safetensors file: its header, then each tensor's values as the stream yields them."""
    write_file(path, [item.spec for item in shard], (_next_one(values) for _ in shard), {"format": "pt"})


def _next_one(values: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The stream's next tensor as a source that write_file lets go of once written (a list would keep it, and the
    gathered group it is a view of, alive until the next tensor is in hand)."""
    yield next(values)


def _write_one_file(path: Path, items: list[Written], values: Iterator[torch.Tensor]) -> Path:
    """One safetensors file at `path` holding every item, under a temporary name until it is complete."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        _write_shard(temporary, items, values)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    temporary.replace(path)
    return path


def _written_by_rank0(engine: Checkpointed, write: Callable[[], Result], values: Iterator[torch.Tensor],
                      where: Path) -> Result | None:
    """write() on rank 0 while every rank goes through all of `values` (their gathers); if rank 0 failed, every
    rank raises (See [Note: save_pretrained streams])."""
    result, failure = None, None
    with closing(values):
        if engine.rank == 0:
            try:
                result = write()
            except Exception as error:  # any failure: the other ranks are in the gathers and must be told
                failure = error
            for _ in values:  # the gathers a failed write did not reach
                pass
        else:
            for _ in engine.view.gathered_in_turn():  # the same gathers, with nothing copied out of them
                pass
    errors = [error for error in session_of(engine).group.all_gather(repr(failure) if failure else None) if error]
    if failure is not None:
        raise failure
    if errors:
        raise RuntimeError(f"rank 0 could not write {where}: {errors[0]}")
    return result


def _config_files(module: nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """config.json (weights in `dtype`) and generation_config.json, as transformers writes them for this model."""
    files = {}
    config = getattr(module, "config", None)
    if hasattr(config, "to_dict"):
        files[CONFIG] = hf_config_text(config.to_dict(), type(module).__name__, dtype)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if hasattr(generation, "to_json_string") and callable(can_generate) and can_generate():
        files[GENERATION_CONFIG] = generation.to_json_string(use_diff=True)
    return files


def _refuse_layouts(engine: Checkpointed, call: str) -> None:
    layout = engine.layout
    if engine.tensor is not None or (layout is not None and (layout.pipeline > 1 or layout.tensor > 1)):
        raise ValueError(f"engine.{call}() of a pipeline or tensor-parallel layout is not offered: each engine holds "
                         "part of the model. Save a checkpoint and write the whole model from it with `zerokit "
                         "consolidate CKPT OUT --format hf`")


# --- loading -----------------------------------------------------------------------------------------

def load_pretrained(engine: Checkpointed, directory: str | Path) -> None:
    """What engine.load_pretrained does: See [Note: load_pretrained reads only what a rank holds]."""
    _refuse_layouts(engine, "load_pretrained")
    session = session_of(engine)
    session.writer.wait()
    directory, sources, error = Path(directory), {}, None
    try:
        files = weight_files(directory)
        sources = source_keys(engine.module, files, directory)
    except Exception as failure:  # a bad name, a missing file, safetensors' SafetensorError: every rank is told
        error = ranked(engine, failure)
    raise_first(session, error)  # every rank checked the keys before any rank reads
    try:
        with engine.view.resident(publish=True):  # masters paged to NVMe: read into their records, then published
            _read_all(engine.view, sources, files, directory)
    except Exception as failure:  # safetensors raises its own SafetensorError; every rank must be told of any
        error = ranked(engine, failure)
    raise_first(session, error)
    engine.view.after_load()  # the masters written -> the model's parameters, on every rank


def weight_files(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of a Hugging Face directory: key -> (its file, its shape). model.safetensors first, as
    from_pretrained looks for it first; else the files model.safetensors.index.json names."""
    if (directory / SINGLE).is_file():
        names = [SINGLE]
    elif (directory / INDEX).is_file():
        names = sorted(set(json.loads((directory / INDEX).read_text())["weight_map"].values()))
    else:
        raise ValueError(f"{directory}: has no {SINGLE} or {INDEX}; load_pretrained reads a Hugging Face model "
                         "directory saved with safetensors")
    tensors = {}
    for name in names:
        with safe_open(directory / name, framework="pt") as file:
            tensors.update({key: (name, tuple(file.get_slice(key).get_shape())) for key in file.keys()})
    return tensors


def source_keys(module: nn.Module, files: dict[str, tuple[str, tuple[int, ...]]], directory: Path) -> dict[str, str]:
    """For each parameter (by its first name) and persistent buffer, the key of the files that holds its values,
    checked: nothing missing, nothing unexpected, the same shapes."""
    ignored = not_saved(module)
    names: dict[int, list[str]] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *persistent_buffers(module)]:
        names.setdefault(id(tensor), []).append(name)
    shapes = {id(t): tuple(t.shape) for t in [*module.parameters(), *(b for _, b in persistent_buffers(module))]}
    sources, missing, aliases = {}, [], declared_aliases(module)
    for tensor_id, tensor_names in names.items():
        found = next((name for name in tensor_names if name in files), None)
        if found is None and not ignored.issuperset(tensor_names):
            missing.append(kept_name(tensor_names, aliases))
        elif found is not None:
            if files[found][1] != shapes[tensor_id]:
                raise ValueError(f"{directory}: {found!r} has shape {files[found][1]} there, {shapes[tensor_id]} in "
                                 "this model")
            sources[tensor_names[0]] = found
    every_name = {name for tensor_names in names.values() for name in tensor_names}
    unexpected = [key for key in files if key not in every_name]
    if missing or unexpected:
        said = [f"it has no {missing[0]!r}"] if missing else []
        said += [f"it has {unexpected[0]!r}, which this model lacks"] if unexpected else []
        raise ValueError(f"{directory}: is not this model's ({type(module).__name__}): {'; '.join(said)}; nothing "
                         "was loaded")
    return sources


def _read_all(view: ParameterView, sources: dict[str, str], files: dict[str, tuple[str, tuple[int, ...]]],
              directory: Path) -> None:
    """Every range this rank holds, file by file: its pieces' masters, its parts of frozen parameters, buffers."""
    wanted: list[tuple[str, int, torch.Tensor]] = []  # (key in the files, first element, where it goes)
    for param in view.trainable():
        wanted += [(sources[param.name], piece.begin, piece.values) for piece in param.pieces]
    wanted += [(sources[part.name], part.begin, part.values) for part in view.frozen() if part.name in sources]
    wanted += [(sources[name], 0, buffer) for name, buffer in view.buffers() if name in sources]
    for file_name in sorted({files[key][0] for key, _, _ in wanted}):
        with safe_open(directory / file_name, framework="pt") as file, torch.no_grad():
            for key, begin, out in wanted:
                if files[key][0] == file_name:
                    read_elements(file, key, files[key][1], begin, out)


def read_elements(file: Any, key: str, shape: tuple[int, ...], begin: int, out: torch.Tensor) -> None:
    """Elements [begin, begin + out.numel()) of tensor `key` (flattened) into `out` (any dtype and device): only
    the rows that hold them are read (get_slice along the first dimension), cast and moved as needed."""
    end = begin + out.numel()
    if end == begin:
        return
    if len(shape) < 2:  # a vector's elements are its rows; a scalar is read whole
        values = file.get_slice(key)[begin:end] if shape else file.get_tensor(key).reshape(1)
    else:
        row = math.prod(shape[1:])
        first, last = begin // row, -(-end // row)
        values = file.get_slice(key)[first:last].reshape(-1)[begin - first * row:end - first * row]
    out.view(-1).copy_(values)


__all__ = ["Written", "gathered_state_dict", "load_pretrained", "output_dtype", "read_elements", "save_pretrained",
           "save_weights_file", "source_keys", "weight_files", "write_plan"]
