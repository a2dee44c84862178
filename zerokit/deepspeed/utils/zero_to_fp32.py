"""`deepspeed.utils.zero_to_fp32` for zerokit: a saved checkpoint's full fp32 state dict, read from zerokit's
checkpoint files (the masters exactly), with no process group. DeepSpeed's per-rank file names
(get_model_state_file, get_optim_files) have no counterpart: a zerokit checkpoint is per parameter, not per rank
(See [Note: a checkpoint is per parameter, not per rank] in zerokit/checkpoint/manifest.py)."""

from __future__ import annotations

import os
from typing import Any

import torch

from zerokit.checkpoint.consolidate import _items, _pieces
from zerokit.checkpoint.files import Readers
from zerokit.checkpoint.locate import checkpoint_directory
from zerokit.checkpoint.manifest import read_manifest


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict in fp32 from `checkpoint_dir` (a save_dir with `latest`, or `tag` in it); keys as
    the model's state_dict has them. exclude_frozen_parameters: trainable parameters only (buffers left out too)."""
    directory = checkpoint_directory(checkpoint_dir, tag)
    manifest = read_manifest(directory)
    items, _ = _items(manifest, torch.float32, exclude_frozen_parameters)  # the consolidator's own reading
    readers = Readers(directory, manifest.files)
    try:
        return {item.spec.key: _tensor(item, readers) for item in items}
    finally:
        readers.close()


def _tensor(item: Any, readers: Readers) -> torch.Tensor:
    pieces = [piece.reshape(-1) for piece in _pieces(item, readers)]
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=item.spec.dtype)
    return flat.reshape(item.spec.shape)


def _per_rank_files(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"deepspeed.utils.zero_to_fp32.{name} names DeepSpeed's per-rank files, which a zerokit "
                         "checkpoint does not have; read it with get_fp32_state_dict_from_zero_checkpoint")
    refuse.__name__ = name
    return refuse


get_model_state_file = _per_rank_files("get_model_state_file")
get_optim_files = _per_rank_files("get_optim_files")

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "get_model_state_file", "get_optim_files"]
