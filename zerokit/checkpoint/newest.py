"""The newest complete checkpoint in a directory, and a resume from it: what the config's `resume` block does at
start-up, as Hugging Face's Trainer does with resume_from_checkpoint=True.

[Note: the newest complete checkpoint]
Complete means committed: a directory of its own whose manifest rank 0 wrote once every rank's file was on disk
(See [Note: an atomic save] in save.py), or a DeepSpeed checkpoint `latest` names. Never a staging directory
(`.<tag>.partial-<id>`, which a killed save leaves, manifest or not: it was never moved into place), and never a
directory without a manifest. Which one:
  1. the one `latest` names, when it is complete (or, for a save killed while it replaced that tag, the checkpoint
     it moved aside: checkpoint_directory in locate.py). `latest` moves only after a commit, so it names the last
     save that finished; a save with save_latest=False (a "best" copy, an evaluation) is not a resume point.
  2. With no `latest` (every save passed save_latest=False, or it was deleted) or one that names nothing complete:
     the complete checkpoint with the most optimizer steps (steps, then micro-steps, then the manifest's time),
     as the Trainer takes the checkpoint-<N> with the largest N; one line names it and why.
  3. None (no directory, an empty one, or nothing complete in it): the run starts fresh, and one line says so.
Every rank loads rank 0's choice, so that ranks that see a shared directory at different moments agree.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from zerokit._support.log import logger
from zerokit.checkpoint.commit import LATEST
from zerokit.checkpoint.deepspeed_import import is_deepspeed_checkpoint
from zerokit.checkpoint.locate import checkpoint_directory, saved_parts
from zerokit.checkpoint.manifest import MANIFEST, Manifest, read_manifest
from zerokit.checkpoint.session import session_of


def newest_checkpoint(load_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `load_dir`, None when there is none (See [Note: the newest complete
    checkpoint])."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        return None
    if (load_dir / MANIFEST).is_file():  # a checkpoint's own directory
        return load_dir
    named = _named_by_latest(load_dir)
    if named is not None:
        return named
    found = {path: _saved_at(path, manifest) for path, manifest in complete_checkpoints(load_dir).items()}
    if not found:
        return None
    newest = max(found, key=found.__getitem__)
    why = "names no complete checkpoint" if (load_dir / LATEST).exists() else "is missing"
    logger.warning(f"{load_dir / LATEST} {why}: the newest complete checkpoint there is {newest.name} "
                   f"({found[newest][0]} optimizer steps)")
    return newest


def _named_by_latest(load_dir: Path) -> Path | None:
    try:
        tag = (load_dir / LATEST).read_text().strip()
    except OSError:
        return None
    if not tag:
        return None
    directory = checkpoint_directory(load_dir)  # the tag's directory, or where a killed commit moved it aside
    if (directory / MANIFEST).is_file() or is_deepspeed_checkpoint(load_dir, tag):
        return directory
    return None


def complete_checkpoints(load_dir: Path) -> dict[Path, Manifest]:
    """The zerokit checkpoints in `load_dir` whose manifest reads, with it, in name order; staging directories
    never."""
    found = {}
    for path in sorted(load_dir.glob(f"*/{MANIFEST}")):
        directory = path.parent
        if directory.name.startswith("."):  # `.<tag>.partial-<id>`, `.<tag>.replaced-<id>`: never committed here
            continue
        try:
            found[directory] = read_manifest(directory)
        except ValueError as error:
            logger.warning(f"{directory}: not a complete checkpoint, passed over ({error})")
    return found


def _saved_at(directory: Path, manifest: Manifest) -> tuple[int, int, float]:
    progress = manifest.progress
    steps = progress.get("optimizer_step", 0) + progress.get("total_skips", 0)
    return steps, progress.get("micro_step", 0), (directory / MANIFEST).stat().st_mtime


def nothing_named(load_dir: str | os.PathLike) -> bool:
    """`load_dir` has no `latest`, is no checkpoint itself and holds no stage's or tensor rank's: DeepSpeed's
    load_checkpoint(load_dir) warns and returns (None, None) there, and the drop-in does as DeepSpeed, naming the
    complete checkpoints it passes over."""
    load_dir = Path(load_dir)
    if saved_parts(load_dir) or is_deepspeed_checkpoint(load_dir):  # a checkpoint, or a layout's parts of one
        return False
    found = [path.name for path in complete_checkpoints(load_dir)] if load_dir.is_dir() else []
    logger.warning(f"{load_dir / LATEST}: missing, so no checkpoint was loaded (as DeepSpeed does)"
                   + (f"; complete checkpoints there: {', '.join(found)} (pass tag=, or resume from the newest with "
                      "the config's resume block)" if found else ""))
    return True


def resume_from_newest(engine: Any, load_dir: str | os.PathLike) -> str | None:
    """Load the newest complete checkpoint in `load_dir` into `engine` (zerokit's Engine or the drop-in's: its own
    load_checkpoint), with its data position, and return its path; None, and the engine left as built, when there is
    none. Every rank calls it (rank 0's choice is every rank's)."""
    began = time.monotonic()
    newest = newest_checkpoint(load_dir) if engine.rank == 0 else None
    newest = session_of(engine).group.all_gather(None if newest is None else str(newest))[0]
    if newest is None:
        if engine.rank == 0:
            logger.info(f"resume: no complete checkpoint in {load_dir}; starting fresh")
        return None
    path, _ = engine.load_checkpoint(Path(newest).parent, tag=Path(newest).name)
    if engine.rank == 0:
        logger.info(f"resume: loaded {path} (optimizer step {engine.progress.optimizer_step}) in "
                    f"{time.monotonic() - began:.2f} s")
    return path


__all__ = ["complete_checkpoints", "newest_checkpoint", "nothing_named", "resume_from_newest"]
