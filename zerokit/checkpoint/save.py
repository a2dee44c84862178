"""engine.save_checkpoint: every rank writes its file, rank 0 writes the manifest, then the checkpoint
is moved into place and `latest` pointed at it.

[Note: an atomic save]
A save writes into a staging directory, `<save_dir>/.<tag>.partial-<id>`, each rank its file under a
temporary name that is flushed, fsynced and renamed. Once every rank has reported its file (a collective:
see session.py), rank 0 writes `manifest.json` the same way, renames the staging directory to
`<save_dir>/<tag>` (an earlier checkpoint of that tag is swapped out first, then removed) and only then
replaces `<save_dir>/latest` (written and renamed too). A rank killed at any point before that leaves
the previous checkpoint and `latest` as they were, and the partial directory is not a checkpoint (it has
no manifest; loading it says so). A kill between moving an earlier checkpoint of the same tag aside
(`.<tag>.replaced-<id>`) and moving the new one in leaves no `<tag>`: the loader then takes the one moved
aside, which is whole (See checkpoint_directory in load.py). A save that fails without a kill (a full disk)
is undone on every rank (See [Note: a save that fails] in commit.py). An asynchronous save copies this rank's
tensors into host buffers and returns; writing and committing go on in a background thread (See session.py).

[Note: a save inside an accumulation window]
A checkpoint holds the model states as the last optimizer step left them, never gradients in flight. A save
in the middle of a window is refused by default: the resumed run would step on fewer micro-batches than the
uninterrupted one, without a word. `within_window=True` saves there all the same, as DDP's checkpoints do:
the window's gradients are left out and the recorded progress holds none (Progress.without_window), so a
resumed run ends its next window where the uninterrupted run would, with only the micro-batches it sees
itself. Lightning needs it: an epoch can end inside a window without a step (on_train_batch_start returning
-1 ends it at once), its ModelCheckpoint then saves, and at the next window's first batch Lightning zeroes
the gradients anyway (See [Note: Lightning ends the accumulation windows] in integrations/lightning.py), so
the resumed run and the uninterrupted one train alike.
"""

from __future__ import annotations

import copy
import os
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import zerokit
from zerokit._support.log import logger
from zerokit.checkpoint.collect import collect
from zerokit.checkpoint.commit import cause, write_and_commit
from zerokit.checkpoint.data_position import DATA_POSITION
from zerokit.checkpoint.dcp.save import refuse_unsavable, save_dcp
from zerokit.checkpoint.faults import SaveFault
from zerokit.checkpoint.manifest import CLIENT_STATE, LR_SCHEDULES, dtype_name, state_dict_keys
from zerokit.checkpoint.optimizer_state import encode_groups
from zerokit.checkpoint.relayout import parallel_record
from zerokit.checkpoint.rng import capture_rng
from zerokit.checkpoint.session import CheckpointGroup, session_of
from zerokit.masters.optimizer import optimizer_kind
from zerokit.checkpoint.checkpointed import Checkpointed, SavedProgress

ZEROKIT, DCP = "zerokit", "dcp"
FORMATS = (ZEROKIT, DCP)

def save_checkpoint(engine: Checkpointed, save_dir: str | os.PathLike, tag: str | None = None,
                    client_state: dict[str, Any] | None = None, save_latest: bool = True,
                    async_save: bool = False, within_window: bool = False, format: str = ZEROKIT) -> bool:
    """Save the engine's full training state under `save_dir/tag` (default tag: global_step<N>, N the
    accumulation boundaries so far). Every rank must call it. With async_save, returns once this rank's
    tensors are copied to host memory; `zerokit.checkpoint.wait(engine)`, the next save or load, or the
    end of the script waits for the rest. See [Note: an atomic save]. within_window: save inside an
    accumulation window too, without its gradients (See [Note: a save inside an accumulation window]).
    format: "zerokit" (safetensors files and a manifest), or "dcp" (torch.distributed.checkpoint, as FSDP2 and
    torchtitan load it: See zerokit/checkpoint/dcp)."""
    if format not in FORMATS:
        raise ValueError(f"save_checkpoint: format={format!r} is not known; accepted: {', '.join(FORMATS)}")
    session = session_of(engine)
    session.writer.wait()
    save_dir = Path(save_dir)
    if format == DCP:
        refuse_unsavable(engine)
        if async_save and engine.rank == 0:
            logger.info("format='dcp' is saved synchronously (async_save applies to zerokit's format)")
    progress = _progress_to_save(engine, save_dir, within_window)
    fault = SaveFault.from_environment()  # See [Note: a save killed on purpose] in faults.py
    tag, nonce = _agree_on_tag(engine, session.group, tag)
    positions = session.group.all_gather(engine.data_position.state())  # See zerokit/checkpoint/data_position.py
    staging = save_dir / f".{tag}.partial-{nonce}"
    description = describe(engine, tag, progress) if engine.rank == 0 else {}
    if engine.rank == 0 and client_state is not None and not isinstance(client_state, dict):
        raise ValueError(f"client_state must be a dict, not {type(client_state).__name__}")
    failed_before = _prepare_staging(engine, staging, description, client_state, positions)
    with engine.view.resident():  # masters paged to NVMe are read from their records
        payload = collect(engine)
        if format == DCP:
            save_dcp(engine, session.group, payload, capture_rng(), staging, save_dir, tag, description, save_latest,
                     failed_before)
        elif async_save:
            payload.entries = session.host.stage(payload.entries)
            session.writer.submit(lambda: write_and_commit(session.group, payload, staging, save_dir, tag,
                                                           description, save_latest, fault, failed_before))
        else:
            write_and_commit(session.group, payload, staging, save_dir, tag, description, save_latest, fault,
                             failed_before)
    return True


def _progress_to_save(engine: Checkpointed, save_dir: Path, within_window: bool) -> SavedProgress:
    """The progress the checkpoint records. A window ends where its last backward said so, not at a multiple of
    gradient_accumulation_steps: the Trainer ends each epoch with a short window
    (set_gradient_accumulation_boundary). See [Note: a save inside an accumulation window]."""
    progress, window = engine.progress, engine.parts.checkpoint.gradient_accumulation_steps
    if not progress.inside_window:
        return progress
    where = f"micro-step {progress.micro_step}, {window} per optimizer step"
    if progress.backward_since_step:
        where += ", a backward not yet stepped"
    if not within_window:
        raise ValueError(f"{save_dir}: cannot save in the middle of an accumulation window ({where}): gradients in "
                         "flight are not saved; save right after the engine.step() that ends a window, or pass "
                         "within_window=True to save without them, as DDP does")
    if engine.rank == 0:
        logger.info(f"{save_dir}: saved inside an accumulation window ({where}) without its gradients, as DDP "
                    "saves; a resumed run starts with none of them")
    return progress.without_window()


def _agree_on_tag(engine: Checkpointed, group: CheckpointGroup, tag: str | None) -> tuple[str, str]:
    """Rank 0's tag (and a staging id) for every rank; other tags are ignored, warned about or refused as
    checkpoint.tag_validation says (Ignore, Warn (default), Fail)."""
    boundaries = engine.progress.optimizer_step + engine.progress.total_skips  # windows ended, short ones too
    tag = str(tag) if tag is not None else f"global_step{boundaries}"
    if not tag or tag.startswith(".") or "/" in tag or "\\" in tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (not empty, no '/', not starting "
                         "with '.')")
    proposals = group.all_gather((tag, uuid.uuid4().hex[:12]))
    agreed, nonce = proposals[0]
    differing = sorted({t for t, _ in proposals if t != agreed})
    if differing:
        mode = engine.parts.checkpoint.tag_validation
        message = f"ranks were given different checkpoint tags ({agreed!r} on rank 0, {differing[0]!r} elsewhere)"
        if mode == "Fail":
            raise ValueError(message + "; checkpoint.tag_validation is Fail")
        if mode == "Warn" and engine.rank == 0:
            logger.warning(message + f"; saving as {agreed!r} (checkpoint.tag_validation: Warn)")
    return agreed, nonce


def _prepare_staging(engine: Checkpointed, staging: Path, description: dict[str, Any],
                     client_state: dict[str, Any] | None, positions: list[dict[str, Any] | None]) -> str | None:
    """The staging directory, and on rank 0 the pickles that must be taken now (the client state, the LR schedules,
    every rank's data position); why not, if that failed (it is
    reported with the rank files' outcome, so that no rank waits for one that raised: See [Note: a save that
    fails] in commit.py)."""
    try:
        staging.mkdir(parents=True, exist_ok=True)
        if engine.rank == 0 and client_state is not None:
            _save_pickle(client_state, staging, CLIENT_STATE)
            description["client_state"] = CLIENT_STATE
        if engine.rank == 0 and engine.lr_schedules:
            _save_pickle([schedule.state_dict() for schedule in engine.lr_schedules], staging, LR_SCHEDULES)
            description["lr_schedules"] = LR_SCHEDULES
        if engine.rank == 0 and any(position is not None for position in positions):
            _save_pickle({rank: position for rank, position in enumerate(positions) if position is not None}, staging,
                         DATA_POSITION)
            description["data_position"] = DATA_POSITION
    except OSError as error:
        return f"rank {engine.rank}: {cause(error)} while preparing {staging.name}"
    return None


def _save_pickle(value: Any, staging: Path, name: str) -> None:
    """Pickled now, on rank 0, in the training thread: the caller may change its objects after we return."""
    temporary = staging / (name + ".tmp")
    with open(temporary, "wb") as file:
        torch.save(value, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, staging / name)


def describe(engine: Checkpointed, tag: str, progress: SavedProgress) -> dict[str, Any]:
    """What rank 0 alone puts in the manifest: the run and the model, not any rank's tensors."""
    part, module = engine.parts.checkpoint, engine.module
    hf_config = getattr(module, "config", None)
    optimizers = engine.view.optimizers
    return {
        "tag": tag, "world_size": engine.world_size, "stage": part.stage,
        "param_dtype": dtype_name(part.param_dtype), "zerokit_version": zerokit.__version__,
        "model": {"class": type(module).__name__, "state_dict": state_dict_keys(module),
                  "hf_config": hf_config.to_dict() if hasattr(hf_config, "to_dict") else None},
        "optimizers": [{"class": type(o).__name__, "param_groups": encode_groups(o),
                        "kind": optimizer_kind(o, part.optimizer_kinds, part.allow_untested_optimizer)}
                       for o in optimizers],
        "progress": asdict(progress), "loss_scaler": engine.loss_scaler.state_dict(),
        "config": copy.deepcopy(dict(part.record)),  # the config's plain fields (config/typed.py's plain_fields)
        "layout": [{"index": b.index, "owner": b.owner, "numel": b.numel,
                    "slots": [[s.name, s.offset, s.numel] for s in b.slots]} for b in engine.view.layout.buckets],
        "parallel": parallel_record(engine.layout, module, engine.tensor.split if engine.tensor else {},
                                    engine.tied_names),
    }

