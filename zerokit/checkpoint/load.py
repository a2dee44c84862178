"""engine.load_checkpoint: resume from a checkpoint saved by any world size at any stage.

[Note: a load fails on every rank or on none]
Each rank reads only what it holds (See restore.py), so a corrupted chunk or a missing file may be found
by one rank alone. A rank that raised there would leave the others waiting in the first collective of
the next step, so every rank catches its error, the ranks exchange them (one small collective, See
session.py) and, if any rank failed, all raise the first error before anything is published. An engine
whose load failed holds a mix of old and new values: load again before training.

A DeepSpeed checkpoint directory (`latest`, `global_stepN/`, its *_model_states.pt and *_optim_states.pt files)
is resumed through the same restore code, read as a manifest (See [Note: a DeepSpeed checkpoint read as a
zerokit manifest] in deepspeed_resume.py); its files are opened and checked before anything is restored.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from zerokit._support.log import logger
from torch.distributed.checkpoint import FileSystemReader

from zerokit.checkpoint.dcp.load import (DcpKeys, check_optimizer, dcp_directory, find_keys, install_groups,
                                         install_state, load_runs, plan_reads, read_description, restore_dcp_rng)
from zerokit.checkpoint.dcp.save import DESCRIPTION, param_group_of
from zerokit.checkpoint.deepspeed_import import deepspeed_directory, is_deepspeed_checkpoint
from zerokit.checkpoint.deepspeed_resume import DeepSpeedReaders, open_deepspeed, restore_schedule
from zerokit.checkpoint.files import Readers
from zerokit.checkpoint.manifest import MANIFEST, Manifest, rank_file, read_manifest, state_dict_keys
from zerokit.checkpoint.locate import checkpoint_directory, is_checkpoint, layout_directory, saved_parts
from zerokit.checkpoint.relayout import RelayoutSource, open_relayout, targets_of
from zerokit.checkpoint.optimizer_state import restore_groups
from zerokit.checkpoint.restore import check_model, restore_buffers, restore_frozen, restore_trainable
from zerokit.checkpoint.rng import RNG_KEYS, restore_rng
from zerokit.checkpoint.session import session_of
from zerokit.checkpoint.checkpointed import Checkpointed



def load_checkpoint(engine: Checkpointed, load_dir: str | os.PathLike, tag: str | None = None,
                    load_optimizer_states: bool = True, load_module_only: bool = False,
                    weights_only: bool = True, load_lr_scheduler_states: bool = True
                    ) -> tuple[str, dict[str, Any] | None]:
    """Resume from `load_dir/tag` (default: the tag in `load_dir/latest`), saved at any world size and
    stage, by zerokit or by DeepSpeed's ZeRO stages 1-3. Returns (the checkpoint's path, the client_state
    saved with it). load_module_only: the weights only (masters, frozen parameters, buffers), as DeepSpeed's
    flag; load_optimizer_states=False: the weights, counters and loss scale, but no optimizer state.
    weights_only: how client_state is unpickled (torch.load's flag; False runs arbitrary code from the file;
    a DeepSpeed checkpoint's is always read with True). load_lr_scheduler_states: the saved LR schedule's state
    goes into the schedules the engine steps (its `scheduler` block's, or a scheduler passed to the drop-in)."""
    session = session_of(engine)
    session.writer.wait()
    dcp = dcp_directory(load_dir, tag)
    if dcp is not None:
        return _load_dcp(engine, session, dcp, load_optimizer_states, load_module_only, weights_only,
                         load_lr_scheduler_states)
    deepspeed = _deepspeed_checkpoint(load_dir, tag)
    own = layout_directory(load_dir, engine.layout)
    parts = None if deepspeed is not None else _parts_of_another_layout(engine, Path(load_dir), own, tag)
    directory = deepspeed or (None if parts else checkpoint_directory(own, tag))
    error, manifest, source = None, None, None
    with_state = load_optimizer_states and not load_module_only
    if deepspeed is not None or parts:  # every rank's files opened and checked before any rank restores anything
        try:
            source = open_deepspeed(deepspeed, engine) if deepspeed is not None else _open_relayout(engine, parts, tag)
            directory = source.directory
        except ValueError as failure:
            error = ranked(engine, failure)
        raise_first(session, error)
    try:
        if source is not None:
            manifest, readers = source.manifest, source.readers
        else:
            manifest = read_manifest(directory)
            check_model(manifest, engine.module, directory)
            readers = Readers(directory, manifest.files)
        _restore_tensors(engine, manifest, readers, with_state)
        if not load_module_only:
            _restore_run(engine, manifest, directory, load_optimizer_states,
                         load_lr_scheduler_states and deepspeed is None, weights_only)
            if deepspeed is not None and load_lr_scheduler_states:
                restore_schedule(engine, source.lr_scheduler, directory)
    except ValueError as failure:
        error = ranked(engine, failure)
    raise_first(session, error)
    engine.view.after_load()  # loaded masters -> compute parameters on every rank
    if deepspeed is not None:
        return str(directory), source.client_state
    return str(directory), client_state_of(directory, manifest, weights_only)


def _load_dcp(engine: Checkpointed, session: Any, directory: Path, load_optimizer_states: bool, load_module_only: bool,
              weights_only: bool, load_lr_scheduler_states: bool) -> tuple[str, dict[str, Any] | None]:
    """A torch.distributed.checkpoint directory, zerokit's or another tool's (See [Note: a DCP checkpoint read by
    runs] in dcp/load.py). Every check is made before DCP's collectives, and any rank's error raised on all."""
    error, description, reads, states, keys = None, None, None, [], None
    with_state = load_optimizer_states and not load_module_only
    group_of = param_group_of(engine, session.group)  # a collective: before anything one rank alone may raise
    try:
        metadata = FileSystemReader(directory).read_metadata()
        keys = find_keys(directory, metadata, model_shapes(engine.module), group_of)
        description = read_description(directory)
        with_state = with_state and _has_optimizer(engine, keys, directory)
        if with_state:
            check_optimizer(engine, keys, description, directory)
        reads, states = plan_reads(engine, keys, with_state, directory)
    except ValueError as failure:
        error = ranked(engine, failure)
    raise_first(session, error)
    with engine.view.resident(publish=True):
        load_runs(reads, directory, session.group.group, weights_only)
        install_state(states, reads)
    if with_state:
        install_groups(engine, keys, reads)
    try:
        if description is not None and with_state:
            restore_dcp_rng(engine, directory, description)
        if description is not None and not load_module_only:  # the hyperparameters came with DCP's param groups
            _restore_run(engine, description, directory, False, load_lr_scheduler_states, weights_only)
    except ValueError as failure:
        error = ranked(engine, failure)
    raise_first(session, error)
    engine.view.after_load()
    return str(directory), client_state_of(directory, description, weights_only)


def _has_optimizer(engine: Checkpointed, keys: DcpKeys, directory: Path) -> bool:
    """Whether the checkpoint holds an optimizer to load (said in one line where it does not, or where zerokit's
    counters are not in it)."""
    if engine.rank == 0 and keys.optimizer is None:
        logger.info(f"{directory}: a DCP checkpoint without an optimizer: the model's weights are loaded, the "
                    "optimizer starts fresh")
    elif engine.rank == 0 and not (directory / DESCRIPTION).is_file():
        logger.info(f"{directory}: a DCP checkpoint of another tool: its model and optimizer are loaded; the step "
                    "counters, LR schedules and random generators stay as they are")
    return keys.optimizer is not None


def model_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in the module's state dict, by key (tied names included)."""
    return {key: tuple(value.shape) for key, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, torch.Tensor)}


def _parts_of_another_layout(engine: Checkpointed, root: Path, own: Path, tag: str | None) -> list[Path] | None:
    """The parts under `root` of a checkpoint saved by another layout than the engine's, to be read as one (See
    [Note: a checkpoint per stage and tensor rank, read as one] in relayout.py); None where the engine's own
    directory holds a checkpoint of its layout, or nothing else is there (the plain path then says what is
    wrong)."""
    if is_checkpoint(own) and _saved_by_this_layout(engine, own, tag):
        return None
    parts = saved_parts(root)
    return parts if parts and parts != [own] else None


def _saved_by_this_layout(engine: Checkpointed, own: Path, tag: str | None) -> bool:
    """The checkpoint in the engine's own directory has its stages, tensor degree and model keys (one saved before
    zerokit recorded a layout counts as this layout's)."""
    try:
        manifest = read_manifest(checkpoint_directory(own, tag))
    except ValueError:
        return True  # the plain path reports it, on every rank
    if manifest.parallel is None:
        return True
    layout = engine.layout
    here = (layout.pipeline, layout.tensor) if layout is not None else (1, 1)
    same_keys = [k for k, _, _ in manifest.model["state_dict"]] == [k for k, _, _ in state_dict_keys(engine.module)]
    return (manifest.parallel["stages"], manifest.parallel["tensors"]) == here and same_keys


def _open_relayout(engine: Checkpointed, parts: list[Path], tag: str | None) -> RelayoutSource:
    share = engine.tensor
    targets = targets_of(engine.module, share.split, share.comm.rank, share.comm.world_size) if share else {}
    source = open_relayout(parts, tag, engine.module, targets)
    if engine.rank == 0:
        logger.info(f"loading {', '.join(part.name for part in parts)}, saved by another layout, into this one: each "
                    "parameter whole, then cut as this engine holds it; random generators not restored")
    return source


def ranked(engine: Checkpointed, failure: Exception) -> str:
    return f"rank {engine.rank}: {failure}" if engine.world_size > 1 else str(failure)


def raise_first(session: Any, error: str | None) -> None:
    """Every rank raises the first rank's error if any rank has one (See [Note: a load fails on every rank or on
    none])."""
    errors = [e for e in session.group.all_gather(error) if e]
    if errors:
        raise ValueError(errors[0])


def foreign_format(load_dir: str | os.PathLike, tag: str | None) -> str | None:
    """"DCP" or "DeepSpeed" for a checkpoint of those formats at load_dir/tag; None for zerokit's (or nothing)."""
    if dcp_directory(load_dir, tag) is not None:
        return "DCP"
    return "DeepSpeed" if _deepspeed_checkpoint(load_dir, tag) is not None else None


def _deepspeed_checkpoint(load_dir: str | os.PathLike, tag: str | None) -> Path | None:
    """The tag directory of a DeepSpeed checkpoint at load_dir/tag (or the tag `latest` names), None for a
    zerokit checkpoint or nothing there."""
    if not is_deepspeed_checkpoint(load_dir, tag):
        return None
    directory = deepspeed_directory(load_dir, tag)
    return None if (directory / MANIFEST).is_file() else directory


def _restore_tensors(engine: Checkpointed, manifest: Manifest, readers: "Readers | DeepSpeedReaders",
                     with_state: bool) -> None:
    directory = readers.directory
    try:
        # masters paged to NVMe: loaded into their records, and published as a step publishes them
        with engine.view.resident(publish=True):
            restore_trainable(engine.view, manifest, readers, directory, with_state)
        restore_frozen(engine.view, manifest, readers)
        restore_buffers(engine.view, manifest, readers)
        if with_state:
            _restore_rng(engine, manifest, readers)
    finally:
        readers.close()


def _restore_run(engine: Checkpointed, manifest: Manifest, directory: Path, hyperparameters: bool, schedules: bool,
                 weights_only: bool) -> None:
    """Where training stands: the counters and loss scale (and the optimizer's hyperparameters), the LR schedules the
    engine steps, and where each rank's loader stood."""
    _restore_counters(engine, manifest, directory, hyperparameters)
    if schedules:
        _restore_schedules(engine, manifest, directory, weights_only)
    _restore_data_position(engine, manifest, directory)


def _restore_counters(engine: Checkpointed, manifest: Manifest, directory: Path, with_state: bool) -> None:
    """Hyperparameters (an LR scheduler's changes), the loss scale, and where training stands."""
    if with_state:
        optimizers = engine.view.optimizers
        if len(optimizers) != len(manifest.optimizers):
            raise ValueError(f"{directory / MANIFEST}: saved with {len(manifest.optimizers)} optimizers, this engine "
                             f"has {len(optimizers)}")
        for optimizer, saved in zip(optimizers, manifest.optimizers):
            restore_groups(optimizer, saved["param_groups"], str(directory / MANIFEST))
    try:
        engine.loss_scaler.load_state_dict(manifest.loss_scaler)
    except ValueError as error:
        raise ValueError(f"{directory / MANIFEST}: {error}") from None
    progress = replace(engine.progress, **manifest.progress)
    window = engine.parts.checkpoint.gradient_accumulation_steps
    saved_window = manifest.config["gradient_accumulation_steps"]
    if window != saved_window:  # keep accumulation windows aligned: micro-steps = boundaries x window
        progress.micro_step = progress.micro_step // saved_window * window
        if engine.rank == 0:
            logger.info(f"resumed with gradient_accumulation_steps={window} (saved with {saved_window}): "
                        f"micro_step counted as {progress.micro_step}")
    engine.progress = progress


def _restore_rng(engine: Checkpointed, manifest: Manifest, readers: Readers) -> None:
    """This rank's generators, if the saving run had this rank; a new rank keeps its own (and says so). A
    DeepSpeed checkpoint saves none."""
    if not manifest.rng:
        return
    if engine.rank not in manifest.rng:
        if engine.rank == manifest.world_size:
            logger.info(f"ranks {manifest.world_size} and up were not in the saved run: their random generators "
                        "are not restored")
        return
    reader = readers(rank_file(engine.rank))
    tensors = {key: reader.read_tensor(key) for key in RNG_KEYS if key in reader.tensors}
    restore_rng(tensors, manifest.rng[engine.rank])


def _restore_schedules(engine: Checkpointed, manifest: Manifest, directory: Path, weights_only: bool) -> None:
    """The LR schedules the engine steps continue where the saved ones stood (a checkpoint without any, as
    zerokit wrote before it saved them, leaves them as they are)."""
    saved = saved_schedules(directory, manifest, weights_only)
    if saved is None:
        return
    if len(saved) != len(engine.lr_schedules):
        raise ValueError(f"{directory / MANIFEST}: saved with {len(saved)} LR schedules, this engine steps "
                         f"{len(engine.lr_schedules)}; resume with the same `scheduler` block (or scheduler)")
    for schedule, state in zip(engine.lr_schedules, saved):
        schedule.load_state_dict(state)


def _restore_data_position(engine: Checkpointed, manifest: Manifest, directory: Path) -> None:
    """Where each rank's loader stood, into the loader the engine tracks (or kept for the one it tracks later: See
    [Note: a position loaded before its loader exists] in data_position.py)."""
    saved = None
    if manifest.data_position is not None:  # a dict of plain values: read with weights_only
        saved = _read_pickle(directory / manifest.data_position, "a data position", weights_only=True)
    engine.data_position.restore(saved, directory)


def saved_schedules(directory: Path, manifest: Manifest, weights_only: bool) -> list[dict[str, Any]] | None:
    """The state_dict() of each LR schedule the saving engine stepped; None when it saved none."""
    if manifest.lr_schedules is None:
        return None
    return _read_pickle(directory / manifest.lr_schedules, "the LR schedules' state", weights_only)


def client_state_of(directory: Path, manifest: Manifest | None, weights_only: bool) -> dict[str, Any] | None:
    if manifest is None or manifest.client_state is None:
        return None
    return _read_pickle(directory / manifest.client_state, "a client_state", weights_only)


def _read_pickle(path: Path, what: str, weights_only: bool) -> Any:
    try:
        return torch.load(path, weights_only=weights_only)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (the manifest says the checkpoint has {what})") from None
    except Exception as error:  # torch.load's unpickler errors have many types
        hint = " (it holds types weights_only=True refuses: pass weights_only=False if you trust the file)" \
            if weights_only else ""
        raise ValueError(f"{path}: cannot be read{hint}: {str(error).splitlines()[0]}") from None
