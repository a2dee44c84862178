"""Read a DeepSpeed ZeRO checkpoint directory (stages 1-3; fp32, bf16 or fp16; any saved world size) into one
per-parameter view: fp32 masters, Adam moments and steps, group hyperparameters, frozen parameters, buffers,
tied names, counters, the LR scheduler and client_state. Torch only: DeepSpeed need not be installed.

    checkpoint = read_deepspeed_checkpoint("ds_ckpt")            # the tag `latest` names, or tag=
    checkpoint.state_dict()                                      # what DeepSpeed's zero_to_fp32 returns

[Note: DeepSpeed's files are read without running their pickles]
DeepSpeed writes its checkpoints with torch.save, so every file is a pickle that names classes. They are
read with torch.load(weights_only=True), which builds only tensors, containers and the globals allowed in
SAFE_GLOBALS: the three DeepSpeed classes its ZeRO files name, each mapped to a small stand-in defined here
(so DeepSpeed is not imported, and a file naming anything else is refused, not executed).

[Note: DeepSpeed's flat layouts]
What each rank holds, as DeepSpeed 0.19.8 writes it (its utils/zero_to_fp32.py and
checkpoint/ds_to_universal.py read the same):
- Stages 1-2: per param group, the group's parameters concatenated in `param_shapes` order (with
  `param_alignment_paddings` between them), the whole padded to a multiple of 2 x world size and cut into
  equal partitions; rank R saves its partition with the group's padding removed
  (`single_partition_of_fp32_groups`, and flat `exp_avg`/`exp_avg_sq` under `base_optimizer_state`), and
  `param_slice_mappings` says where each parameter's fragment starts in it. A parameter is the
  concatenation of its fragments in rank order.
- Stage 3: per sub-group (a param group, or a piece of one of at most sub_group_size elements), every
  parameter is cut separately into world-size pieces of ceil(numel / world size), the last padded, and rank R
  concatenates its pieces (`fp32_flat_groups`, the optimizer state under `optimizer_state_dict`). Frozen
  parameters are cut the same way, one padded piece per rank in `frozen_param_fragments`.
- Tied weights: `shared_params` maps the second name to the first (rank 0's model file holds the map).
"""

from __future__ import annotations

import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

LATEST = "latest"
STAGE12_KEYS = ("single_partition_of_fp32_groups", "base_optimizer_state", "param_slice_mappings", "partition_count")
STAGE3_KEYS = ("fp32_flat_groups", "optimizer_state_dict", "partition_count")
MODEL_KEYS = ("module", "buffer_names", "param_shapes", "shared_params", "global_steps")
# What DeepSpeed's engine writes into a model file itself; every other key is the caller's client_state.
DEEPSPEED_MODEL_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info"})
OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint that cannot be read: a file missing or truncated, or a layout not known here."""


@dataclass
class FragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address: where a parameter's fragment starts in a
    rank's flat partition, and how long it is."""

    numel: int = 0
    start: int = 0


class SavedLossScaler:
    """Stand-in for DeepSpeed's LossScaler / DynamicLossScaler: only their attributes are kept."""

    def state(self) -> dict[str, Any]:
        return dict(vars(self))


SAFE_GLOBALS = [(FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
                (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),  # an IntEnum: its value is all we need
                (SavedLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
                (SavedLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")]


@dataclass
class DeepSpeedParam:
    """One trainable parameter as the checkpoint holds it, whole (all ranks' fragments joined)."""

    name: str
    group: int  # the optimizer param group it belongs to
    master: torch.Tensor  # fp32, the parameter's shape
    exp_avg: torch.Tensor | None  # the parameter's shape; None before the first optimizer step
    exp_avg_sq: torch.Tensor | None
    step: torch.Tensor | None  # the torch optimizer's step count (a scalar tensor)


@dataclass
class DeepSpeedCheckpoint:
    """Everything a DeepSpeed ZeRO checkpoint says about the run, per parameter name."""

    directory: Path
    ds_version: str
    stage: int
    world_size: int  # the data-parallel size it was saved at
    precision: str  # fp32, bf16 or fp16
    params: dict[str, DeepSpeedParam]  # trainable parameters, in DeepSpeed's flat order
    param_groups: list[dict[str, Any]]  # each group's hyperparameters (lr, betas, ...), without "params"
    frozen: dict[str, torch.Tensor]  # frozen parameters, as saved (a bf16 run saves them in bf16)
    buffers: dict[str, torch.Tensor]
    shared: dict[str, str]  # tied name -> the name whose values it shares
    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: dict[str, Any] | None
    loss_scaler: dict[str, Any]
    ds_config: dict[str, Any]
    client_state: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict DeepSpeed's get_fp32_state_dict_from_zero_checkpoint returns: buffers, frozen
        parameters, fp32 masters, then tied names (the same tensor as the name they share)."""
        state = dict(self.buffers)
        state.update(self.frozen)
        state.update({name: param.master for name, param in self.params.items()})
        state.update({alias: state[source] for alias, source in self.shared.items() if source in state})
        return state

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter and buffer name the model had, with its shape (tied names included)."""
        return {name: tuple(tensor.shape) for name, tensor in self.state_dict().items()}


def is_deepspeed_checkpoint(load_dir: str | os.PathLike, tag: str | None = None) -> bool:
    """Whether `load_dir` (a save_dir with `latest`, or one tag's directory) holds a DeepSpeed checkpoint."""
    try:
        directory = deepspeed_directory(load_dir, tag)
    except DeepSpeedCheckpointError:
        return False
    return directory.is_dir() and any(MODEL_FILE.match(p.name) for p in directory.iterdir())


def deepspeed_directory(load_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """`load_dir/tag`, or the tag `load_dir/latest` names, or `load_dir` itself if it holds the rank files."""
    load_dir = Path(load_dir)
    if tag is not None:
        return load_dir / str(tag)
    if load_dir.is_dir() and any(MODEL_FILE.match(p.name) for p in load_dir.iterdir()):
        return load_dir
    latest = load_dir / LATEST
    if not latest.is_file():
        raise DeepSpeedCheckpointError(f"{latest}: missing, so no tag to load; pass tag=")
    return load_dir / latest.read_text().strip()


def read_deepspeed_checkpoint(load_dir: str | os.PathLike, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Read a DeepSpeed ZeRO checkpoint whole (See [Note: DeepSpeed's flat layouts])."""
    directory = deepspeed_directory(load_dir, tag)
    if not directory.is_dir():
        raise DeepSpeedCheckpointError(f"{directory}: missing (no such checkpoint directory)")
    model_paths, optim_paths, precision = _rank_files(directory)
    models = [_load(path) for path in model_paths]
    optims = [_load(path) for path in optim_paths]
    model = models[0]
    _require(model, MODEL_KEYS, model_paths[0])
    for path, optim in zip(optim_paths, optims):
        _require(optim, ("optimizer_state_dict",), path)
    optimizer_states = [optim["optimizer_state_dict"] for optim in optims]
    stage = _stage(optimizer_states[0], optim_paths[0])
    _check_world_size(optimizer_states[0], len(optims), optim_paths[0])
    if stage == 3:
        params, groups = _stage3_params(model, optimizer_states, optim_paths)
        frozen = _stage3_frozen(models, model_paths)
    else:
        params, groups = _stage12_params(model, optimizer_states, optim_paths)
        frozen = _stage12_frozen(model, params)
    buffers = {name: model["module"][name] for name in model["buffer_names"]}
    scaler = optimizer_states[0].get("loss_scaler")
    return DeepSpeedCheckpoint(
        directory=directory, ds_version=str(model.get("ds_version")), stage=stage, world_size=len(optims),
        precision=precision or _config_precision(model.get("ds_config") or {}), params=params, param_groups=groups,
        frozen=frozen, buffers=buffers, shared=dict(model["shared_params"] or {}),
        global_steps=int(model["global_steps"]), global_samples=int(model.get("global_samples") or 0),
        skipped_steps=int(model.get("skipped_steps") or 0), lr_scheduler=model.get("lr_scheduler"),
        loss_scaler=scaler.state() if isinstance(scaler, SavedLossScaler) else dict(scaler or {}),
        ds_config=dict(model.get("ds_config") or {}),
        client_state={k: v for k, v in model.items() if k not in DEEPSPEED_MODEL_KEYS})


def check_model(checkpoint: DeepSpeedCheckpoint, named_shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse, in one line, a checkpoint of another model: names or shapes differ from `named_shapes` (the
    model's parameters and buffers, tied names included)."""
    check_shapes(checkpoint.directory, checkpoint.shapes(), named_shapes)


def check_shapes(directory: Path, saved: dict[str, tuple[int, ...]], named_shapes: dict[str, tuple[int, ...]]) -> None:
    """check_model's test on the names and shapes a checkpoint holds (`saved`)."""
    missing, unexpected = sorted(set(named_shapes) - set(saved)), sorted(set(saved) - set(named_shapes))
    if missing or unexpected:
        raise DeepSpeedCheckpointError(
            f"{directory}: a checkpoint of another model: the model has {_few(missing)} that it lacks"
            f" and it has {_few(unexpected)} that the model lacks")
    for name, shape in named_shapes.items():
        if tuple(shape) != tuple(saved[name]):
            raise DeepSpeedCheckpointError(f"{directory}: a checkpoint of another model: {name} is "
                                           f"{list(saved[name])} there and {list(shape)} in the model")


def _few(names: list[str]) -> str:
    return "nothing" if not names else ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _rank_files(directory: Path) -> tuple[list[Path], list[Path], str | None]:
    """(model files, optimizer files, each in rank order; the precision the optimizer files' prefix names)."""
    names = sorted(p.name for p in directory.iterdir())
    for name in names:
        parallel = re.search(r"mp_rank_(\d+)", name)
        if (parallel and int(parallel.group(1)) != 0) or name.startswith(("layer_", "expp_rank_")):
            raise DeepSpeedCheckpointError(
                f"{directory / name}: a pipeline-, tensor- or expert-parallel DeepSpeed checkpoint; only "
                "data-parallel ZeRO checkpoints (mp_rank_00 alone) are read")
    optims = {int(m.group(2)): (directory / name, m.group(1)) for name in names if (m := OPTIM_FILE.match(name))}
    models = {int(m.group(1) or 0): directory / name for name in names if (m := MODEL_FILE.match(name))}
    if not models:
        raise DeepSpeedCheckpointError(f"{directory}: no *_model_states.pt file (mp_rank_00_model_states.pt or "
                                       "zero_pp_rank_0_mp_rank_00_model_states.pt): not a DeepSpeed checkpoint")
    if not optims:
        raise DeepSpeedCheckpointError(f"{directory}: no zero_pp_rank_*_optim_states.pt files: not a DeepSpeed "
                                       "ZeRO checkpoint (saved without ZeRO, or its optimizer files are missing)")
    for ranks, what in ((sorted(optims), "zero_pp_rank_R_mp_rank_00_optim_states.pt"),
                        (sorted(models), "zero_pp_rank_R_mp_rank_00_model_states.pt")):
        if ranks != list(range(len(ranks))):
            gap = min(set(range(max(ranks) + 1)) - set(ranks))
            raise DeepSpeedCheckpointError(f"{directory}: {what.replace('R', str(gap))}: missing (ranks found: "
                                           f"{', '.join(map(str, ranks))})")
    prefix = optims[0][1]
    return [models[r] for r in sorted(models)], [optims[r][0] for r in sorted(optims)], \
        {"bf16_": "bf16", "fp16_": "fp16"}.get(prefix or "")


def _load(path: Path) -> dict[str, Any]:
    """One DeepSpeed file, without running its pickle (See [Note: DeepSpeed's files are read without running
    their pickles])."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise DeepSpeedCheckpointError(f"{path}: missing") from None
    except pickle.UnpicklingError as error:
        detail = str(error).split("\n\n")[-1].splitlines()[0] if str(error) else type(error).__name__
        raise DeepSpeedCheckpointError(f"{path}: holds types this reader does not allow ({detail[:160]}): a "
                                       "DeepSpeed layout not known here, or not a DeepSpeed file") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as error:  # OSError: mmap of a short file
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise DeepSpeedCheckpointError(f"{path}: truncated or not a torch.save file ({first[:160]})") from None
    if not isinstance(loaded, dict):
        raise DeepSpeedCheckpointError(f"{path}: holds a {type(loaded).__name__}, not a DeepSpeed checkpoint dict")
    return loaded


def _require(state: dict, keys: Iterable[str], path: Path) -> None:
    missing = [key for key in keys if key not in state]
    if missing:
        version = state.get("ds_version", "unknown")
        raise DeepSpeedCheckpointError(f"{path}: lacks {', '.join(missing)}: a DeepSpeed (version {version}) layout "
                                       "not known here; DeepSpeed 0.19.8's ZeRO layouts are read")


def _stage(optimizer_state: dict, path: Path) -> int:
    if "zero_stage" not in optimizer_state:
        _require(optimizer_state, ("zero_stage",), path)
    stage = int(optimizer_state["zero_stage"])
    if stage not in (1, 2, 3):
        raise DeepSpeedCheckpointError(f"{path}: zero_stage {stage}; stages 1, 2 and 3 are read")
    _require(optimizer_state, STAGE3_KEYS if stage == 3 else STAGE12_KEYS, path)
    return stage


def _check_world_size(optimizer_state: dict, files: int, path: Path) -> None:
    counts = optimizer_state["partition_count"]
    count = max(counts) if isinstance(counts, list) else int(counts)
    if count != files:
        raise DeepSpeedCheckpointError(f"{path}: saved by {count} ranks but {files} optimizer files are here (an "
                                       "overwritten checkpoint, or a rank that did not save)")


def _config_precision(config: dict) -> str:
    for key in ("bf16", "bfloat16", "fp16"):
        if (config.get(key) or {}).get("enabled"):
            return "fp16" if key == "fp16" else "bf16"
    return "fp32"


def _hyperparameters(groups: list[dict]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def _joined(fragments: list[torch.Tensor], shape: torch.Size, name: str, path: Path) -> torch.Tensor:
    numel = math.prod(shape)
    whole = torch.cat(fragments) if fragments else torch.empty(0)
    if whole.numel() != numel:
        raise DeepSpeedCheckpointError(f"{path.parent}: {name}'s fragments hold {whole.numel()} elements, its shape "
                                       f"{list(shape)} needs {numel}: a DeepSpeed layout not known here")
    return whole.view(shape).clone()


def _stage12_params(model: dict, optimizer_states: list[dict], paths: list[Path]
                    ) -> tuple[dict[str, DeepSpeedParam], list[dict[str, Any]]]:
    """Stages 1-2: each parameter joined from its rank fragments (See [Note: DeepSpeed's flat layouts])."""
    params = {}
    base = [state["base_optimizer_state"] for state in optimizer_states]
    if not isinstance(base[0], dict) or "param_groups" not in base[0]:
        _require({}, ("base_optimizer_state.param_groups",), paths[0])
    for group, shapes in enumerate(model["param_shapes"]):
        flats = {"master": [s["single_partition_of_fp32_groups"][group] for s in optimizer_states]}
        moments = [b["state"].get(group, {}) for b in base]
        for key in ("exp_avg", "exp_avg_sq"):
            if all(key in m for m in moments):
                flats[key] = [m[key] for m in moments]
        for name, shape in shapes.items():
            joined = {key: [] for key in flats}
            for rank, state in enumerate(optimizer_states):
                address = state["param_slice_mappings"][group].get(name)
                if address is not None:
                    for key, per_rank in flats.items():
                        joined[key].append(per_rank[rank].narrow(0, address.start, address.numel))
            tensors = {key: _joined(pieces, shape, name, paths[0]) for key, pieces in joined.items()}
            params[name] = DeepSpeedParam(name, group, tensors["master"], tensors.get("exp_avg"),
                                          tensors.get("exp_avg_sq"), moments[0].get("step"))
    return params, _hyperparameters(base[0]["param_groups"])


def _stage12_frozen(model: dict, params: dict[str, DeepSpeedParam]) -> dict[str, torch.Tensor]:
    """Stage 2 saves frozen parameters whole in frozen_param_fragments; stage 1 saves them only in `module`."""
    fragments = model.get("frozen_param_fragments")
    if fragments is not None:
        return {name: tensor.clone() for name, tensor in fragments.items()}
    others = set(params) | set(model["buffer_names"]) | set(model["shared_params"] or {})
    return {name: tensor.clone() for name, tensor in model["module"].items() if name not in others}


def _stage3_piece(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """(elements rank `rank` stores for a parameter of `numel`, of which real, not padding)."""
    piece = math.ceil(numel / world_size)
    return piece, max(0, min(piece, numel - rank * piece))


def _stage3_params(model: dict, optimizer_states: list[dict], paths: list[Path]
                   ) -> tuple[dict[str, DeepSpeedParam], list[dict[str, Any]]]:
    """Stage 3: per sub-group, each parameter's padded pieces joined across ranks."""
    world_size = len(optimizer_states)
    torch_states = [state["optimizer_state_dict"] for state in optimizer_states]
    groups = torch_states[0]["param_groups"]
    group_of = {sub: g for g, group in enumerate(groups) for sub in group["params"]}
    sub_groups = model["param_shapes"]
    if len(sub_groups) != len(optimizer_states[0]["fp32_flat_groups"]):
        raise DeepSpeedCheckpointError(f"{paths[0]}: {len(optimizer_states[0]['fp32_flat_groups'])} flat groups "
                                       f"but {len(sub_groups)} param_shapes groups: a layout not known here")
    params = {}
    for sub, shapes in enumerate(sub_groups):
        flats = {"master": [s["fp32_flat_groups"][sub] for s in optimizer_states]}
        moments = [t["state"].get(sub, {}) for t in torch_states]
        for key in ("exp_avg", "exp_avg_sq"):
            if all(key in m for m in moments):
                flats[key] = [m[key] for m in moments]
        offset = 0
        for name, shape in shapes.items():
            pieces = {key: [] for key in flats}
            for rank in range(world_size):
                stored, real = _stage3_piece(math.prod(shape), world_size, rank)
                for key, per_rank in flats.items():
                    pieces[key].append(per_rank[rank].narrow(0, offset, real))
            offset += _stage3_piece(math.prod(shape), world_size, 0)[0]
            tensors = {key: _joined(p, shape, name, paths[0]) for key, p in pieces.items()}
            params[name] = DeepSpeedParam(name, group_of.get(sub, sub), tensors["master"], tensors.get("exp_avg"),
                                          tensors.get("exp_avg_sq"), moments[0].get("step"))
    return params, _hyperparameters(groups)


def _stage3_frozen(models: list[dict], paths: list[Path]) -> dict[str, torch.Tensor]:
    shapes = models[0].get("frozen_param_shapes") or {}
    frozen = {}
    for name, shape in shapes.items():
        for path, model in zip(paths, models):
            if name not in (model.get("frozen_param_fragments") or {}):
                raise DeepSpeedCheckpointError(f"{path}: lacks frozen parameter {name}'s fragment")
        whole = torch.cat([model["frozen_param_fragments"][name] for model in models])
        frozen[name] = _joined([whole.narrow(0, 0, math.prod(shape))], shape, name, paths[0])
    return frozen
