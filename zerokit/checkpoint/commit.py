"""Writing a save's files and committing them: every rank its file, then rank 0 the manifest, the move into place
and `latest` (See [Note: an atomic save] in save.py); a failure on any rank is every rank's one-line error.

[Note: a save that fails]
A rank whose write fails (a full disk, a quota, a file-size limit, a permission) must not leave the others waiting
for it, and must not leave anything a loader could take for a checkpoint. So every rank catches what its write
raised and reports it in the collective that gathers the file records; if any rank failed, every rank raises the
first report, one line naming the checkpoint, the directory, the rank and the cause (a full disk as `the disk is
full (ENOSPC)`), and rank 0 removes the staging directory, every rank's partial file with it (the files are on a
shared filesystem, and every rank is past its write once the reports are gathered). A commit that fails on rank 0
(the manifest or `latest` cannot be written) is undone: the new checkpoint is taken out, an earlier one of the
same tag put back, and every rank raises. The checkpoint `latest` named is left as it was, and the engine's state
is untouched (a save only reads it), so training goes on, and the next save to a place with room succeeds.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from zerokit.checkpoint.collect import RankPayload
from zerokit.checkpoint.faults import COMMIT, NO_FAULT, SaveFault
from zerokit.checkpoint.files import fsync_dir, write_file
from zerokit.checkpoint.manifest import MANIFEST, Manifest, RankReport, merge_parts, rank_file
from zerokit.checkpoint.session import CheckpointGroup

LATEST = "latest"
DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
               errno.EFBIG: "the file would pass this process's file-size limit"}


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; raised alike on every rank (See [Note: a save that fails])."""


def write_and_commit(group: CheckpointGroup, payload: RankPayload, staging: Path, save_dir: Path, tag: str,
                     description: dict[str, Any], save_latest: bool, fault: SaveFault = NO_FAULT,
                     failed_before: str | None = None) -> None:
    """Write this rank's file; then, once every rank has, rank 0 commits (See [Note: an atomic save] in save.py).
    failed_before: why this rank could not prepare the save (its staging directory, rank 0's pickles)."""
    rank = group.rank
    report = _write_rank_file(rank, payload, staging, fault) if failed_before is None else \
        RankReport(rank, None, [], {}, error=failed_before)
    reports = group.all_gather(report)
    failed = [r.error for r in reports if r.error]
    if failed:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointSaveError(not_saved(tag, save_dir, failed[0]))
    error = None
    if rank == 0:
        try:
            _commit(reports, staging, save_dir, tag, description, save_latest, fault)
        except OSError as failure:
            shutil.rmtree(staging, ignore_errors=True)
            error = not_saved(tag, save_dir, f"rank 0: {cause(failure)} while committing it")
    error = group.all_gather(error)[0]
    if error:
        raise CheckpointSaveError(error)


def _write_rank_file(rank: int, payload: RankPayload, staging: Path, fault: SaveFault) -> RankReport:
    name = rank_file(rank)
    try:
        record = write_file(staging / (name + ".tmp"), [e.spec for e in payload.entries],
                            [e.sources for e in payload.entries],
                            {"format": "pt", "zerokit": "checkpoint rank file", "rank": str(rank)},
                            after_tensor=fault.half_way(len(payload.entries)))
        os.replace(staging / (name + ".tmp"), staging / name)
        return RankReport(rank, record, payload.parts, payload.rng)
    except Exception as error:  # every rank must still reach the collective that gathers the reports
        return RankReport(rank, None, [], {}, error=f"rank {rank}: {cause(error)} while writing {name}")


def cause(error: BaseException) -> str:
    """What went wrong, in one line: a full disk (or quota, or file-size limit) by name and errno."""
    code = getattr(error, "errno", None)
    if code in DISK_ERRORS:
        return f"{DISK_ERRORS[code]} ({errno.errorcode[code]}: {os.strerror(code)})"
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def not_saved(tag: str, save_dir: Path, why: str) -> str:
    latest = save_dir / LATEST
    try:
        kept = f"`latest` still names {latest.read_text().strip()!r}"
    except OSError:
        kept = "there is no `latest` there"
    return f"checkpoint {tag!r} was not saved in {save_dir}: {why}; nothing of it was kept and {kept}"


def _commit(reports: list[RankReport], staging: Path, save_dir: Path, tag: str, description: dict[str, Any],
            save_latest: bool, fault: SaveFault) -> None:
    manifest = Manifest(**description, params=merge_parts(reports), files={r.file.name: r.file for r in reports},
                        rng={r.rank: r.rng for r in reports})
    write_text(staging / MANIFEST, manifest.to_json())
    move_into_place(staging, save_dir, tag, save_latest, fault)


def move_into_place(staging: Path, save_dir: Path, tag: str, save_latest: bool, fault: SaveFault = NO_FAULT) -> None:
    """The staging directory, whole, becomes `save_dir/tag` (an earlier one of that tag swapped out), then `latest`
    names it; undone if a step fails (See [Note: an atomic save] in save.py)."""
    fsync_dir(staging)
    final = save_dir / tag
    replaced = save_dir / f".{tag}.replaced-{staging.name.rsplit('-', 1)[-1]}"
    if final.exists():
        os.replace(final, replaced)
        fault.at(COMMIT)
    try:
        os.replace(staging, final)
        fsync_dir(save_dir)
        if save_latest and _latest_tag(save_dir) != tag:
            write_text(save_dir / LATEST, tag)
            fsync_dir(save_dir)
    except OSError:
        _undo(final, replaced, staging)
        raise
    for leftover in [*save_dir.glob(f".{tag}.replaced-*"), *save_dir.glob(f".{tag}.partial-*")]:
        shutil.rmtree(leftover, ignore_errors=True)  # this save's, and those of saves that were killed


def _latest_tag(save_dir: Path) -> str | None:
    try:
        return (save_dir / LATEST).read_text().strip()
    except OSError:
        return None


def _undo(final: Path, replaced: Path, staging: Path) -> None:
    """Back to before the commit: the new checkpoint out, the one it replaced back in."""
    if not staging.exists():
        shutil.rmtree(final, ignore_errors=True)
    if replaced.exists():
        os.replace(replaced, final)


def write_text(path: Path, text: str) -> None:
    """`text` in `path`, written under a temporary name, flushed, fsynced and renamed."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
    except OSError:
        temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)
