"""The Hugging Face model directory, as transformers' save_pretrained writes it and from_pretrained reads it: the
weight files' names, how tensors are cut into shards, the index, config.json, and which of a tie's names is written.
Both writers of such a directory use it, so that they write one layout: engine.save_pretrained (a running engine,
pretrained.py) and `zerokit consolidate --format hf` (a checkpoint on disk, consolidate.py).

[Note: a model directory is published, not written]
Every file of the directory is first written under a temporary name (`<name>.tmp`) and only renamed into place once
all of them are complete, the weights first and the index after them; then the weight files of an earlier save that
the new one does not have are removed (a `model.safetensors` left beside a new index would be loaded instead of it,
as from_pretrained prefers the single file). A failure while writing removes the temporary files and touches nothing
else: no half-written model.safetensors, no index naming shards that are not there. The renames are not one atomic
step: a crash among them can leave new shards beside an old index (never a truncated file), which the next save
replaces.

[Note: tied weights are written once]
safetensors has no way to give one tensor two names, so transformers' save_pretrained leaves out the alias of each tie
(remove_tied_weights_from_state_dict: of the names that share a tensor, those matching the model's declared
`_tied_weights_keys`, such as lm_head.weight tied to the embedding) and from_pretrained ties them again after loading.
Here, of each tensor's state-dict names, the first one that the model does not declare a tied alias is written and
the others are left out; with no declaration to read (a plain nn.Module, or a checkpoint's manifest, which keeps the
names but not the declarations) it is the first name in state-dict order. That is the same name for every
transformers model whose tie source is registered before its alias, as an LM's embedding is before its head.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Protocol, Sequence, TypeVar

import torch
from torch import nn

from zerokit.checkpoint.files import TensorSpec, fsync_dir

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # 5GB: transformers' save_pretrained default in 4.x (5.x writes up to 50GB)
SINGLE, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30, "TIB": 2**40}


class Planned(Protocol):
    """A tensor to be written: what its file's header says about it."""

    @property
    def spec(self) -> TensorSpec: ...


Item = TypeVar("Item", bound=Planned)


def parse_size(text: str | int, what: str = "--max-shard-size") -> int:
    """'5GB' -> 5_000_000_000, '2GiB' -> 2**31 (transformers' spelling of max_shard_size); an int is bytes."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    number = str(text).strip().rstrip("bBiIkKmMgGtT")
    unit = str(text).strip()[len(number):].upper()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or value <= 0:
        raise ValueError(f"{what} {text!r} is not a size; use e.g. 5GB, 500MB or 2GiB")
    return int(value * SIZE_UNITS[unit])


def shard_plan(items: Sequence[Item], max_shard_bytes: int) -> list[list[Item]]:
    """Consecutive tensors, each shard under max_shard_bytes (a larger tensor is a shard of its own)."""
    shards: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.spec.nbytes
    return shards


def weight_names(count: int) -> list[str]:
    """transformers' names for `count` weight files."""
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_text(shards: list[list[Item]], names: list[str], total_parameters: int) -> str:
    """model.safetensors.index.json as transformers 5 writes it: the sizes, then each key's file, by key."""
    weight_map = {item.spec.key: name for name, shard in zip(names, shards) for item in shard}
    total_size = sum(item.spec.nbytes for shard in shards for item in shard)
    return json.dumps({"metadata": {"total_parameters": total_parameters, "total_size": total_size},
                       "weight_map": dict(sorted(weight_map.items()))}, indent=2)


def hf_config_text(config: dict, model_class: str, dtype: torch.dtype) -> str:
    """transformers' config.json, saying which dtype the weights are in."""
    config = dict(config)
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    if "dtype" not in config and "torch_dtype" not in config:
        config["torch_dtype"] = name
    if not config.get("architectures"):
        config["architectures"] = [model_class]
    return json.dumps(config, indent=2, sort_keys=True)


def declared_aliases(module: nn.Module) -> list[str]:
    """The state-dict names (patterns, as transformers matches them) that the model declares as aliases of a tied
    weight: every submodule's `_tied_weights_keys` (a dict alias -> source in transformers 5, a list before)."""
    aliases = []
    for prefix, submodule in module.named_modules():
        for key in getattr(submodule, "_tied_weights_keys", None) or ():
            aliases.append(f"{prefix}.{key}" if prefix else key)
    return aliases


def kept_name(names: Sequence[str], aliases: Sequence[str]) -> str:
    """Which of one tensor's state-dict names (in state-dict order) is written. See [Note: tied weights are written
    once]."""
    declared = [name for name in names if any(re.search(alias, name) for alias in aliases)]
    return next((name for name in names if name not in declared), names[0])


def write_directory(out: Path, items: Sequence[Item], max_shard_bytes: int,
                    write_weights: Callable[[Path, list[Item]], object], total_parameters: int,
                    other_files: dict[str, str] | None = None) -> list[Path]:
    """A Hugging Face directory at `out`: `items` in shards of at most max_shard_bytes, each written by
    write_weights(path, shard), an index when there are several, and `other_files` (name -> text: config.json).
    Returns the paths written: the weight files, the index, the other files. See [Note: a model directory is
    published, not written]."""
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_plan(items, max_shard_bytes)
    names = weight_names(len(shards))
    texts = dict(other_files or {})
    if len(shards) > 1:
        texts = {INDEX: index_text(shards, names, total_parameters), **texts}
    written: list[Path] = []
    try:
        for name, shard in zip(names, shards):
            written.append(_temporary(out / name))
            write_weights(written[-1], shard)
        for name, text in texts.items():
            written.append(_temporary(out / name))
            written[-1].write_text(text)
    except BaseException:
        for path in written:
            if path.is_file():  # not what stood in the way of writing it
                path.unlink()
        raise
    return _publish(out, written)


def _temporary(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _publish(out: Path, temporaries: list[Path]) -> list[Path]:
    """Rename every temporary file into place, in order, then remove the weight files of an earlier save that this
    one does not have."""
    final = [path.with_name(path.name.removesuffix(".tmp")) for path in temporaries]
    for temporary, path in zip(temporaries, final):
        os.replace(temporary, path)
    names = {path.name for path in final}
    for path in out.iterdir():
        stale = path.name in (SINGLE, INDEX) or SHARD_NAME.fullmatch(path.name) is not None
        if stale and path.name not in names and path.is_file():
            path.unlink()
    fsync_dir(out)
    return final
