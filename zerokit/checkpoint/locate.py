"""Where a checkpoint is: the directory of a tag (or where a killed commit moved it aside), and where each stage and
tensor rank of a layout saves under the directory the caller names (See [Note: a checkpoint per stage and tensor rank,
read as one] in relayout.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zerokit._support.log import logger
from zerokit.checkpoint.commit import LATEST
from zerokit.checkpoint.manifest import MANIFEST

STAGE_DIR, TENSOR_DIR = re.compile(r"stage(\d+)$"), re.compile(r"tensor(\d+)-of-(\d+)$")


def checkpoint_directory(load_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """`load_dir/tag`, or the tag `load_dir/latest` names; `load_dir` itself if it is a checkpoint."""
    load_dir = Path(load_dir)
    if tag is None and (load_dir / MANIFEST).is_file():
        return load_dir
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            found = sorted(p.parent.name for p in load_dir.glob(f"*/{MANIFEST}") if not p.parent.name.startswith("."))
            raise ValueError(f"{latest}: missing, so no tag to load; pass tag= (checkpoints here: "
                             f"{', '.join(found) or 'none'})")
        tag = latest.read_text().strip()
    return _moved_aside(load_dir / str(tag))


def _moved_aside(directory: Path) -> Path:
    """`directory`, or where a save killed in its commit left the checkpoint it was replacing: whole, and the
    checkpoint of that tag before the killed save (See [Note: an atomic save] in save.py)."""
    if directory.exists():
        return directory
    aside = sorted(p for p in directory.parent.glob(f".{directory.name}.replaced-*") if (p / MANIFEST).is_file())
    if not aside:
        return directory
    logger.warning(f"{directory}: missing, as a save of that tag was killed while it replaced the checkpoint there; "
                   f"loading that checkpoint from {aside[0].name}")
    return aside[0]


def layout_directory(root: str | Path, layout: Any) -> Path:
    """Where the engine of this rank's stage and tensor rank saves under `root` (See [Note: a checkpoint per stage
    and tensor rank, read as one]); `root` itself without a layout."""
    root = Path(root)
    if layout is None:
        return root
    stage, _, tensor = layout.coordinates(dist.get_rank())
    if layout.pipeline > 1:
        root = root / f"stage{stage}"
    if layout.tensor > 1:
        root = root / f"tensor{tensor}-of-{layout.tensor}"
    return root


def is_checkpoint(directory: Path) -> bool:
    return (directory / MANIFEST).is_file() or (directory / LATEST).is_file()


def saved_parts(root: str | Path) -> list[Path]:
    """The directories under `root` of a checkpoint saved per stage and tensor rank, stage by stage and tensor rank
    by tensor rank; [root] where root is a checkpoint itself; [] where there is none."""
    root = Path(root)
    if is_checkpoint(root):
        return [root]
    stages = _numbered(root, STAGE_DIR) or [root]
    parts = []
    for stage in stages:
        tensors = _numbered(stage, TENSOR_DIR)
        parts += tensors or ([stage] if is_checkpoint(stage) else [])
    return parts


def _numbered(directory: Path, pattern: re.Pattern) -> list[Path]:
    found = [(int(m.group(1)), path) for path in (directory.glob("*") if directory.is_dir() else [])
             if path.is_dir() and (m := pattern.match(path.name))]
    return [path for _, path in sorted(found)]
