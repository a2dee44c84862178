"""Resume a DeepSpeed ZeRO checkpoint in a zerokit engine, through zerokit's own restore path.

    source = open_deepspeed(directory, engine)     # checks the model, opens only the files this rank reads
    restore_trainable(engine, source.manifest, source.readers, ...)   # restore.py, as for a zerokit checkpoint

[Note: a DeepSpeed checkpoint read as a zerokit manifest]
restore.py resumes a zerokit checkpoint per parameter: a Manifest says which rank file holds which element
range [begin, end) of each flattened parameter, and Readers serve those ranges. A DeepSpeed checkpoint holds
the same facts in another shape (See [Note: DeepSpeed's flat layouts] in deepspeed_import.py): each DeepSpeed
rank keeps, per parameter, one contiguous run of its elements inside a flat tensor of its files. So this module
computes, from the shapes in rank 0's model file and the saved world size, a Manifest whose parts are those
runs (one part per DeepSpeed rank, named rank_file(rank) as zerokit's parts are), and DeepSpeedReaders whose
"rank files" read each run as a narrow of the flat tensor DeepSpeed saved. The restore, the engine's pieces at
any world size and stage, and the counters then go through the code a zerokit checkpoint goes through.

Each rank opens rank 0's two files (the shapes, the hyperparameters, the counters) and the files of the
DeepSpeed ranks whose runs overlap the pieces it steps and holds, and nothing else; the files are memory-mapped
(torch.load(mmap=True)), so only the pages of those runs are read. (zerokit's shards follow its buckets, in
backward order, DeepSpeed's its flat groups, in forward order, so a rank's pieces usually overlap every
DeepSpeed rank's file: it is the memory map that keeps a rank to the bytes it needs.) Every file a rank needs is opened
and checked against the computed layout before anything is restored, so a missing, truncated or foreign file fails
before the engine changes (See [Note: a load fails on every rank or on none] in load.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from zerokit._support.log import logger
from zerokit.checkpoint.deepspeed_import import (DEEPSPEED_MODEL_KEYS, MODEL_KEYS, DeepSpeedCheckpointError,
                                                 _check_world_size, _config_precision, _load, _rank_files, _require,
                                                 _stage, check_shapes)
from zerokit.checkpoint.files import TensorSpec
from zerokit.checkpoint.manifest import (BUFFER, FROZEN, MASTER, Manifest, ParamRecord, dtype_name, rank_file,
                                         state_key, values_key)
from zerokit.checkpoint.optimizer_state import encode_hyperparameters, encode_scalar
from zerokit.checkpoint.checkpointed import Checkpointed


PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
Source = tuple[Any, ...]  # keys from a rank's loaded files ({"optim": ..., "model": ...}) down to a flat tensor


@dataclass(frozen=True)
class Run:
    """Elements [begin, end) of one flattened parameter, kept by DeepSpeed rank `rank` from `offset` on in the
    flat tensor at `source` of its files."""

    rank: int
    begin: int
    end: int
    source: Source
    offset: int


@dataclass
class Layout:
    """Where every parameter, frozen parameter and buffer of the checkpoint lies, per DeepSpeed rank."""

    stage: int
    world_size: int
    runs: dict[str, list[Run]] = field(default_factory=dict)  # values of each parameter, frozen one and buffer
    state_runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)  # per parameter, per state key
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)  # trainable name -> its optimizer param group
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)  # trainable name -> step, ... as saved


class DeepSpeedRankFile:
    """One DeepSpeed rank's files seen as a zerokit rank file: `param/<name>`, `state/<key>/<name>` and
    `buffer/<name>` are that rank's run of each (See [Note: a DeepSpeed checkpoint read as a zerokit
    manifest])."""

    def __init__(self, rank: int, runs: dict[str, tuple[Run, torch.dtype]], files: Callable[[], dict[str, Any]]):
        self.rank, self.runs, self._files = rank, runs, files
        self.tensors = {key: None for key in runs}

    def spec(self, key: str) -> TensorSpec:
        run, dtype = self._run(key)
        return TensorSpec(key, dtype, (run.end - run.begin,))

    def read_into(self, key: str, begin: int, out: torch.Tensor) -> None:
        out.view(-1).copy_(self._flat(key).narrow(0, begin, out.numel()))

    def read_elements(self, key: str, begin: int, end: int) -> torch.Tensor:
        return self._flat(key).narrow(0, begin, end - begin).clone()

    def read_tensor(self, key: str) -> torch.Tensor:
        run, _ = self._run(key)
        return self.read_elements(key, 0, run.end - run.begin)

    def _run(self, key: str) -> tuple[Run, torch.dtype]:
        if key not in self.runs:
            raise DeepSpeedCheckpointError(f"DeepSpeed rank {self.rank}'s files hold no {key} (an internal bug)")
        return self.runs[key]

    def _flat(self, key: str) -> torch.Tensor:
        """This rank's run of `key`, as a 1-D view of the (memory-mapped) flat tensor it lies in."""
        run, _ = self._run(key)
        tensor = _follow(self._files(), run.source)
        return tensor.reshape(-1).narrow(0, run.offset, run.end - run.begin)


class DeepSpeedReaders:
    """Readers' interface over a DeepSpeed checkpoint: rank_file(R) is DeepSpeed rank R's files."""

    def __init__(self, directory: Path, layout: Layout, model_paths: list[Path], optim_paths: list[Path]) -> None:
        self.directory, self.layout = directory, layout
        self.model_paths, self.optim_paths = model_paths, optim_paths
        self.loaded: dict[int, dict[str, Any]] = {}
        self.views = {rank_file(rank): self._view(rank) for rank in range(layout.world_size)}

    def __call__(self, name: str) -> DeepSpeedRankFile:
        if name not in self.views:
            raise DeepSpeedCheckpointError(f"{self.directory}: no DeepSpeed rank holds {name} (an internal bug)")
        return self.views[name]

    def open(self, rank: int, files: dict[str, Any] | None = None) -> dict[str, Any]:
        """DeepSpeed rank `rank`'s optimizer file (and at stage 3 its model file), memory-mapped, checked;
        `files`: those already loaded."""
        if rank not in self.loaded:
            if files is None:
                files = {"optim": _load(self.optim_paths[rank])}
                _require(files["optim"], ("optimizer_state_dict",), self.optim_paths[rank])
                if self.layout.stage == 3 or rank == 0:
                    files["model"] = _load(self.model_paths[rank])
            _check_rank_files(self.layout, rank, files, self.optim_paths[rank])
            self.loaded[rank] = files
        return self.loaded[rank]

    def close(self) -> None:
        self.loaded.clear()  # the memory maps go with the last reference to their tensors

    def _view(self, rank: int) -> DeepSpeedRankFile:
        runs = {}
        for name, name_runs in self.layout.runs.items():
            for run in name_runs:
                if run.rank == rank:
                    runs[values_key(name, self.layout.roles[name])] = (run, self.layout.dtypes[name])
        for name, keys in self.layout.state_runs.items():
            for key, key_runs in keys.items():
                for run in key_runs:
                    if run.rank == rank:
                        runs[state_key(key, name)] = (run, self.layout.dtypes[state_key(key, name)])
        return DeepSpeedRankFile(rank, runs, lambda: self.open(rank))


@dataclass
class DeepSpeedSource:
    """A DeepSpeed checkpoint ready for restore.py: the manifest and readers it reads through, and what a
    DeepSpeed engine's load_checkpoint restores besides (its LR scheduler, its client_state)."""

    directory: Path
    manifest: Manifest
    readers: DeepSpeedReaders
    lr_scheduler: dict[str, Any] | None
    client_state: dict[str, Any]


def open_deepspeed(directory: Path, engine: Checkpointed) -> DeepSpeedSource:
    """Read the layout of the DeepSpeed checkpoint in `directory`, check that it is of this engine's model and
    optimizer, and open the files this rank reads. Raises DeepSpeedCheckpointError (one line) before anything
    of the engine is changed."""
    model_paths, optim_paths, precision = _rank_files(directory)
    model, optim = _load(model_paths[0]), _load(optim_paths[0])
    _require(model, MODEL_KEYS, model_paths[0])
    _require(optim, ("optimizer_state_dict",), optim_paths[0])
    optimizer_state = optim["optimizer_state_dict"]
    stage = _stage(optimizer_state, optim_paths[0])
    _check_world_size(optimizer_state, len(optim_paths), optim_paths[0])
    try:
        layout, param_groups = _layout(model, optimizer_state, stage, len(optim_paths))
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise DeepSpeedCheckpointError(f"{optim_paths[0]}: a DeepSpeed (version {model.get('ds_version')}) layout "
                                       f"not known here ({type(error).__name__}: {error})") from None
    _check_engine(directory, layout, param_groups, engine)
    readers = DeepSpeedReaders(directory, layout, model_paths, optim_paths)
    readers.open(0, {"optim": optim, "model": model})
    for rank in sorted(_ranks_needed(layout, engine)):
        readers.open(rank)
    manifest = _manifest(directory, layout, model, optimizer_state, param_groups, precision, engine)
    return DeepSpeedSource(directory, manifest, readers, model.get("lr_scheduler"),
                           {key: value for key, value in model.items() if key not in DEEPSPEED_MODEL_KEYS})


def restore_schedule(engine: Checkpointed, saved: dict[str, Any] | None, directory: Path) -> None:
    """DeepSpeed's saved LR scheduler state into the schedule the engine steps. A `scheduler` block's schedule
    saves only its position (`last_batch_iteration`, counted from -1), which zerokit's DeepSpeedLR counts as
    last_epoch = last_batch_iteration + 1; the learning rates themselves came with the param groups. A torch
    scheduler passed to initialize() saved its own state_dict, which it loads as saved."""
    schedules = engine.lr_schedules
    if saved is None or not schedules:
        if saved is not None and engine.rank == 0:
            logger.info(f"{directory}: the DeepSpeed run's LR scheduler state is not restored: this engine steps none")
        return
    if len(schedules) != 1:
        raise DeepSpeedCheckpointError(f"{directory}: DeepSpeed saved one LR scheduler, this engine steps "
                                       f"{len(schedules)}")
    # a scheduler passed to initialize() is wrapped (zerokit/deepspeed/engine.py ClientSchedule): its position is
    # the wrapped scheduler's (the drop-in then copies the restored learning rates to the user's optimizer: See
    # [Note: a scheduler passed to initialize])
    target = getattr(schedules[0], "scheduler", schedules[0])
    if set(saved) == {"last_batch_iteration"} and hasattr(target, "last_epoch"):
        target.last_epoch = int(saved["last_batch_iteration"]) + 1
        target._last_lr = [float(group["lr"]) for group in target.optimizer.param_groups]  # torch's get_last_lr()
    else:
        target.load_state_dict(saved)


# --- the layout --------------------------------------------------------------------------------------

def _layout(model: dict, optimizer_state: dict, stage: int, world_size: int) -> tuple[Layout, list[dict]]:
    layout = Layout(stage, world_size)
    if stage == 3:
        torch_state = optimizer_state["optimizer_state_dict"]
        groups = torch_state["param_groups"]
        group_of = {sub: g for g, group in enumerate(groups) for sub in group["params"]}
        for sub, shapes in enumerate(model["param_shapes"]):
            source = ("optim", "optimizer_state_dict", "fp32_flat_groups", sub)
            state = torch_state["state"].get(sub, {})
            _stage3_runs(layout, shapes, source, group_of.get(sub, sub), state,
                         ("optim", "optimizer_state_dict", "optimizer_state_dict", "state", sub))
        _stage3_frozen(layout, model.get("frozen_param_shapes") or {}, model)
    else:
        base = optimizer_state["base_optimizer_state"]
        groups = base["param_groups"]
        for group, shapes in enumerate(model["param_shapes"]):
            _stage12_runs(layout, shapes, group, base["state"].get(group, {}))
        _stage12_frozen(layout, model)
    for name in model["buffer_names"]:
        _whole(layout, name, BUFFER, model["module"][name], ("model", "module", name))
    for alias, source in (model["shared_params"] or {}).items():
        _alias(layout, alias, source)
    return layout, groups


def _trainable(layout: Layout, name: str, shape: Any, group: int, state: dict[str, Any]) -> None:
    layout.shapes[name], layout.roles[name], layout.dtypes[name] = tuple(shape), MASTER, torch.float32
    layout.groups[name], layout.runs[name], layout.state_runs[name] = group, [], {}
    layout.scalars[name] = {key: value for key, value in state.items() if not _per_element(value)}
    for key, value in state.items():
        if _per_element(value):
            layout.state_runs[name][key] = []
            layout.dtypes[state_key(key, name)] = value.dtype


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _stage12_runs(layout: Layout, shapes: dict[str, Any], group: int, state: dict[str, Any]) -> None:
    """Stages 1-2: the group's parameters back to back, padded to a multiple of 2 x world size, cut into equal
    partitions; rank R keeps [R x P, (R + 1) x P) of it, from 0 in its flat tensors."""
    total = sum(math.prod(shape) for shape in shapes.values())
    alignment = 2 * layout.world_size
    partition = math.ceil(total / alignment) * alignment // layout.world_size
    offset = 0
    for name, shape in shapes.items():
        _trainable(layout, name, shape, group, state)
        numel = math.prod(shape)
        for rank in range(layout.world_size):
            first, last = max(offset, rank * partition), min(offset + numel, (rank + 1) * partition)
            if first >= last:
                continue
            where = first - rank * partition
            layout.runs[name].append(Run(rank, first - offset, last - offset,
                                         ("optim", "optimizer_state_dict", "single_partition_of_fp32_groups", group),
                                         where))
            for key in layout.state_runs[name]:
                layout.state_runs[name][key].append(Run(
                    rank, first - offset, last - offset,
                    ("optim", "optimizer_state_dict", "base_optimizer_state", "state", group, key), where))
        offset += numel


def _stage3_runs(layout: Layout, shapes: dict[str, Any], source: Source, group: int, state: dict[str, Any],
                 state_source: Source) -> None:
    """Stage 3: each parameter cut into world-size pieces of ceil(numel / world size) (the last padded); rank R
    keeps its piece of each, back to back."""
    offset = 0
    for name, shape in shapes.items():
        _trainable(layout, name, shape, group, state)
        for run in _pieces(math.prod(shape), layout.world_size, source, offset):
            layout.runs[name].append(run)
            for key in layout.state_runs[name]:
                layout.state_runs[name][key].append(Run(run.rank, run.begin, run.end, (*state_source, key), offset))
        offset += math.ceil(math.prod(shape) / layout.world_size)


def _pieces(numel: int, world_size: int, source: Source, offset: int) -> list[Run]:
    piece = math.ceil(numel / world_size)
    return [Run(rank, rank * piece, min(numel, (rank + 1) * piece), source, offset)
            for rank in range(world_size) if rank * piece < numel]


def _stage3_frozen(layout: Layout, shapes: dict[str, Any], model: dict) -> None:
    for name, shape in shapes.items():
        layout.shapes[name], layout.roles[name] = tuple(shape), FROZEN
        layout.dtypes[name] = model["frozen_param_fragments"][name].dtype
        layout.runs[name] = _pieces(math.prod(shape), layout.world_size, ("model", "frozen_param_fragments", name), 0)


def _stage12_frozen(layout: Layout, model: dict) -> None:
    """Stage 2 saves frozen parameters whole in frozen_param_fragments; stage 1 only in `module`."""
    fragments = model.get("frozen_param_fragments")
    if fragments is not None:
        for name, tensor in fragments.items():
            _whole(layout, name, FROZEN, tensor, ("model", "frozen_param_fragments", name))
        return
    others = set(layout.runs) | set(model["buffer_names"]) | set(model["shared_params"] or {})
    for name, tensor in model["module"].items():
        if name not in others:
            _whole(layout, name, FROZEN, tensor, ("model", "module", name))


def _whole(layout: Layout, name: str, role: str, tensor: torch.Tensor, source: Source) -> None:
    """A tensor rank 0's model file holds whole."""
    layout.shapes[name], layout.roles[name], layout.dtypes[name] = tuple(tensor.shape), role, tensor.dtype
    layout.runs[name] = [Run(0, 0, tensor.numel(), source, 0)]


def _alias(layout: Layout, alias: str, source: str) -> None:
    """A tied name reads its source's values (zerokit may name a tied parameter by either of its names)."""
    for table in (layout.runs, layout.state_runs, layout.shapes, layout.roles, layout.dtypes, layout.groups,
                  layout.scalars):
        if source in table:
            table[alias] = table[source]
    for key, dtype in list(layout.dtypes.items()):
        if key.endswith(f"/{source}") and key.startswith("state/"):
            layout.dtypes[key.removesuffix(source) + alias] = dtype


def _follow(files: dict[str, Any], source: Source) -> torch.Tensor:
    value: Any = files
    for key in source:
        value = value[key]
    return value


def _check_rank_files(layout: Layout, rank: int, files: dict[str, Any], path: Path) -> None:
    """The flat tensors of this rank's files are as long as the computed layout says; at stages 1-2 its
    param_slice_mappings agree with it (a run elsewhere would be read as the wrong parameter's values)."""
    needs: dict[Source, int] = {}
    for name_runs in [*layout.runs.values(), *(r for keys in layout.state_runs.values() for r in keys.values())]:
        for run in name_runs:
            if run.rank == rank:
                needs[run.source] = max(needs.get(run.source, 0), run.offset + run.end - run.begin)
    try:
        for source, numel in needs.items():
            tensor = _follow(files, source)
            if tensor.numel() < numel:
                raise DeepSpeedCheckpointError(f"{path}: {'.'.join(map(str, source[1:]))} holds {tensor.numel()} "
                                               f"elements, the layout needs {numel}: a DeepSpeed layout not known here")
        if layout.stage != 3:
            _check_slice_mappings(layout, rank, files["optim"]["optimizer_state_dict"]["param_slice_mappings"], path)
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise DeepSpeedCheckpointError(f"{path}: a DeepSpeed layout not known here ({type(error).__name__}: "
                                       f"{error})") from None


def _check_slice_mappings(layout: Layout, rank: int, mappings: list[dict[str, Any]], path: Path) -> None:
    for name, group in layout.groups.items():
        if name not in mappings[group]:
            continue  # a tied alias, or no fragment here
        address = mappings[group][name]
        runs = [run for run in layout.runs[name] if run.rank == rank]
        if address.numel and (not runs or (runs[0].offset, runs[0].end - runs[0].begin) !=
                              (address.start, address.numel)):
            raise DeepSpeedCheckpointError(
                f"{path}: param_slice_mappings puts {name} at [{address.start}, +{address.numel}), the packed layout "
                "at another place (parameter alignment padding?): a DeepSpeed layout not known here")


def _ranks_needed(layout: Layout, engine: Checkpointed) -> set[int]:
    """The DeepSpeed ranks whose runs overlap what this engine rank steps and holds (rank 0 always)."""
    view = engine.view
    wanted = [(param.name, piece.begin, piece.begin + piece.values.numel())
              for param in view.trainable() for piece in param.pieces]
    wanted += [(part.name, part.begin, part.begin + part.values.numel()) for part in view.frozen()]
    return {0} | {run.rank for name, begin, end in wanted for run in layout.runs[name]
                  if run.begin < end and begin < run.end}


# --- the engine's side -------------------------------------------------------------------------------

def _check_engine(directory: Path, layout: Layout, param_groups: list[dict], engine: Checkpointed) -> None:
    """Of this model (names and shapes, tied names included), with one optimizer of as many param groups, each
    parameter in the group it was in, and an optimizer that keeps the saved state's kind."""
    module = engine.module
    named = {name: tuple(p.shape) for name, p in module.named_parameters(remove_duplicate=False)}
    named.update({name: tuple(b.shape) for name, b in engine.view.buffers()})
    check_shapes(directory, layout.shapes, named)
    optimizers = engine.view.optimizers
    if len(optimizers) != 1:
        raise DeepSpeedCheckpointError(f"{directory}: a DeepSpeed checkpoint has one optimizer, this engine "
                                       f"{len(optimizers)}")
    optimizer = optimizers[0]
    if len(optimizer.param_groups) != len(param_groups):
        raise DeepSpeedCheckpointError(f"{directory}: saved with {len(param_groups)} param groups, this engine's "
                                       f"{type(optimizer).__name__} has {len(optimizer.param_groups)}")
    for param in engine.view.trainable():
        group = param.pieces[0].group
        if layout.groups.get(param.name, group) != group:
            raise DeepSpeedCheckpointError(f"{directory}: {param.name} was in param group {layout.groups[param.name]} "
                                           f"there, in group {group} here")
    saved_keys = {key for keys in layout.state_runs.values() for key in keys}
    if {"exp_avg", "exp_avg_sq"} <= saved_keys and "adam" not in type(optimizer).__name__.lower():
        raise DeepSpeedCheckpointError(f"{directory}: holds Adam's state (exp_avg, exp_avg_sq), this engine steps "
                                       f"{type(optimizer).__name__}; resume with Adam or AdamW")


def _manifest(directory: Path, layout: Layout, model: dict, optimizer_state: dict, param_groups: list[dict],
              precision: str | None, engine: Checkpointed) -> Manifest:
    """The Manifest restore.py and load.py read, with DeepSpeed's runs as its parts."""
    optimizer = engine.view.optimizers[0]
    device = torch.device("cpu")
    params = {}
    for name, runs in layout.runs.items():
        trainable = layout.roles[name] == MASTER
        state = tuple(layout.state_runs.get(name, {})) if trainable else ()
        scalars = {key: encode_scalar(value, device) for key, value in layout.scalars.get(name, {}).items()}
        params[name] = ParamRecord(layout.roles[name], dtype_name(layout.dtypes[name]), layout.shapes[name],
                                   [(run.rank, run.begin, run.end) for run in runs], 0 if trainable else None,
                                   layout.groups.get(name), False, state, scalars)
    global_steps, skipped = int(model["global_steps"]), int(model.get("skipped_steps") or 0)
    config = dict(model.get("ds_config") or {})
    window = int(config.get("gradient_accumulation_steps") or 1)
    return Manifest(
        tag=directory.name, world_size=layout.world_size, stage=layout.stage,
        param_dtype=PRECISION_DTYPES[precision or _config_precision(config)],
        zerokit_version=f"DeepSpeed {model.get('ds_version')}",
        model={"class": "DeepSpeed checkpoint", "hf_config": None,
               "state_dict": [[name, name, "buffer" if layout.roles[name] == BUFFER else "param"]
                              for name in layout.shapes]},
        params=params,
        optimizers=[{"class": type(optimizer).__name__, "kind": "element-wise",
                     "param_groups": [encode_hyperparameters(group) for group in param_groups]}],
        progress={"micro_step": global_steps * window, "optimizer_step": global_steps - skipped,
                  "total_skips": skipped, "consecutive_skips": 0},
        loss_scaler=loss_scaler_state(optimizer_state.get("loss_scaler"), engine.loss_scaler.state_dict()),
        files={}, rng={}, config={"gradient_accumulation_steps": window}, layout=[])


def loss_scaler_state(saved: Any, current: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's saved loss scaler (fp32 and bf16 runs save a static one of scale 1) as zerokit's state dict,
    over `current` (the engine's). DeepSpeed's DynamicLossScaler counts the clean updates since the last overflow
    as cur_iter - last_overflow_iter - 1 (runtime/fp16/loss_scaler.py), which is zerokit's clean_steps;
    cur_hysteresis is hysteresis_left. (fp16: read per DeepSpeed's source; DeepSpeed cannot write an fp16 run on
    a CPU, so no real fp16 file has been read.)"""
    state = saved.state() if hasattr(saved, "state") else dict(saved or {})
    mapped = {**current, "scale": float(state.get("cur_scale", 1.0))}
    if state.get("dynamic") and "cur_iter" in state:
        mapped["clean_steps"] = int(state["cur_iter"]) - int(state.get("last_overflow_iter", -1)) - 1
        mapped["hysteresis_left"] = int(state.get("cur_hysteresis", mapped.get("hysteresis_left", 1)))
    return mapped
