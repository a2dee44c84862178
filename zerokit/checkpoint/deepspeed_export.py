"""The way back: a zerokit checkpoint written in DeepSpeed's universal checkpoint layout, which DeepSpeed loads
with `"checkpoint": {"load_universal": true}` at any world size and ZeRO stage. Torch only: DeepSpeed need
not be installed to write it.

    convert_to_universal("ckpt", "ds_ckpt")        # then DeepSpeed: engine.load_checkpoint("ds_ckpt")

[Note: what DeepSpeed's universal loader reads]
DeepSpeed 0.19.8's `checkpoint/ds_to_universal.py` writes, for a checkpoint tag, `<out>/<tag>/` and
`<out>/latest_universal` (the tag). Under the tag:
- `zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`: `{"param": the whole tensor, "cat_dim": 0}` per
  trainable parameter, by its first name (`named_parameters()`, so a tied weight once), and `step.pt`: the
  Adam step as the torch optimizer keeps it (a 0-dim tensor). Each loading rank cuts its own fragment out
  (universal_checkpoint.load_hp_checkpoint_state at stages 1-2, stage3.load_hp_checkpoint_state at 3). It
  also writes `zero/<key>/fp32.pt` for every other key of the model's state dict (frozen parameters,
  buffers, a tied weight's second name), which no loader reads: a universal load does not touch the
  module, so frozen parameters and buffers keep the values the model was built with.
- `zero/optimizer_state.pt`: the ZeRO optimizer's global state; `param_groups` (per group, restored into the
  groups at stages 1-2), `ds_version` (required), and, read by the ZeRO-3 loader only,
  `optimizer_state_dict` = {"state": {0: {"step": ...}}, "param_groups": [...]}.
- the model-states file the engine globs for its stage: `mp_rank_00_model_states.pt` at stages 1-2,
  `zero_pp_rank_0_mp_rank_00_model_states.pt` at stage 3 (a universal checkpoint converted by DeepSpeed from
  one stage has only its stage's file, so it does not load at the other). Both are written here, so the
  target stage is the loading run's choice. From it the engine reads `lr_scheduler`, `global_steps`,
  `global_samples`, `skipped_steps`, `dp_world_size`, `mp_world_size`, and returns every key it does not
  know as client_state; the rest (`module`, `param_shapes`, `shared_params`, ...) is written as DeepSpeed
  writes it, for its tools.

[Note: one param group's hyperparameters at ZeRO-3]
DeepSpeed 0.19.8's ZeRO-3 universal load (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3)
copies `optimizer_state_dict["param_groups"][0]` into every param group, so two groups with different
weight_decay would both get group 0's. That record therefore holds only the hyperparameters every group
agrees on: a key that differs keeps, at stage 3, the value the loading run built its optimizer with, as
in the saving run (stages 1-2 restore each group's own values from `param_groups`).

The same loader gives every sub-group (a param group, or a piece of one past sub_group_size) the one `step`
tensor it read, and torch's Adam counts `step += 1` in place, so after such a load each step counts once per
sub-group and the bias corrections drift from the first step on. No file can avoid that (it holds one step);
a checkpoint DeepSpeed's own ds_to_universal wrote loads the same way. After `load_checkpoint` at stage 3 with
more than one sub-group, give each its own: `for state in engine.optimizer.optimizer.state.values():
state["step"] = state["step"].clone()` (tests/scripts/ds_universal.py's unshare_steps does, and its test checks
that the steps were shared).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerokit.checkpoint.deepspeed_import import is_deepspeed_checkpoint
from zerokit.checkpoint.files import Readers
from zerokit.checkpoint.load import client_state_of, saved_schedules
from zerokit.checkpoint.locate import checkpoint_directory
from zerokit.checkpoint.manifest import BUFFER, MASTER, MANIFEST, Manifest, ParamRecord, dtype_of, rank_file, \
    read_manifest, state_key, values_key
from zerokit.checkpoint.optimizer_state import decode_scalar
from zerokit.checkpoint.commit import LATEST

LAYOUT_VERSION = "0.19.8"  # the DeepSpeed whose universal layout is written (its ds_version)
LATEST_UNIVERSAL = "latest_universal"
ADAM_STATE = ("exp_avg", "exp_avg_sq")  # what ds_to_universal carries, and all the ZeRO-3 loader reads
SCHEDULES_KEY = "zerokit.lr_schedules"  # where zerokit.deepspeed's save_checkpoint keeps its LR schedules
STAGE12_MODEL_FILE = "mp_rank_00_model_states.pt"
STAGE3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


@dataclass
class Converted:
    """What convert_to_universal() wrote."""

    out: Path  # the save_dir DeepSpeed loads (latest_universal names the tag)
    tag: str
    params: int  # trainable parameters written with their optimizer state
    groups: int  # param groups (more than one: See [Note: one param group's hyperparameters at ZeRO-3])
    bytes: int  # bytes of all files written
    seconds: float


def convert_to_universal(checkpoint: str | os.PathLike, out: str | os.PathLike, tag: str | None = None,
                         weights_only: bool = True) -> Converted:
    """Write the zerokit checkpoint `checkpoint` (a save_dir with `latest`, or one checkpoint's directory) in
    DeepSpeed's universal layout under the new directory `out` (absent or empty; never overwritten): `out/<tag>/`
    and `out/latest_universal`. See [Note: what DeepSpeed's universal loader reads]. weights_only: how the
    client_state is unpickled (False runs code from the file)."""
    started = time.perf_counter()
    out = Path(os.path.abspath(out))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory; a conversion never overwrites a "
                         "checkpoint: name a new directory")
    directory = _zerokit_directory(checkpoint, tag)
    manifest = read_manifest(directory)
    trainable = check_convertible(manifest, directory)
    client_state = client_state_of(directory, manifest, weights_only) or {}
    schedules = saved_schedules(directory, manifest, weights_only)
    if schedules is None:  # the drop-in kept them in its client_state before checkpoints held them
        schedules = client_state.pop(SCHEDULES_KEY, None)
    staging = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:12]}")
    readers = Readers(directory, manifest.files)
    try:
        folder = staging / manifest.tag
        module = _write_params(folder / "zero", manifest, trainable, readers)
        _save(folder / "zero" / "optimizer_state.pt", optimizer_state(manifest, trainable))
        model_states = model_state(manifest, trainable, module, client_state, schedules)
        _save(folder / STAGE12_MODEL_FILE, model_states)
        _save(folder / STAGE3_MODEL_FILE,
              {**model_states, "module": _partitioned(module, set(model_states["buffer_names"]))})
        (staging / LATEST_UNIVERSAL).write_text(manifest.tag)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        readers.close()
        shutil.rmtree(staging, ignore_errors=True)
    written = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    return Converted(out, manifest.tag, len(trainable), len(manifest.optimizers[0]["param_groups"]), written,
                     time.perf_counter() - started)


def _zerokit_directory(checkpoint: str | os.PathLike, tag: str | None) -> Path:
    """The zerokit checkpoint to convert, or a one-line error saying why `checkpoint` is not one."""
    source = Path(checkpoint)
    if is_deepspeed_checkpoint(source, tag) and not (source / MANIFEST).is_file():
        raise ValueError(f"{source}: a DeepSpeed checkpoint, not a zerokit one; DeepSpeed's own ds_to_universal.py "
                         "converts it")
    if not source.is_dir():
        raise ValueError(f"{source}: no such directory (a zerokit save_dir or one checkpoint's directory)")
    if tag is None and not (source / MANIFEST).is_file() and not (source / LATEST).is_file():
        raise ValueError(f"{source}: not a zerokit checkpoint (no {MANIFEST}, and no `{LATEST}` naming one)")
    return checkpoint_directory(source, tag)


def check_convertible(manifest: Manifest, directory: Path) -> dict[str, ParamRecord]:
    """The trainable parameters, by name, once the checkpoint is known to fit DeepSpeed's universal layout: one
    Adam-like optimizer (exp_avg, exp_avg_sq, step) that has stepped, and no fp16 loss scaler."""
    where = directory / MANIFEST
    if len(manifest.optimizers) != 1:
        raise ValueError(f"{where}: saved with {len(manifest.optimizers)} optimizers; DeepSpeed's universal layout "
                         "holds one")
    if manifest.param_dtype == "float16":
        raise ValueError(f"{where}: an fp16 run; its loss scaler is a DeepSpeed object in the universal layout, which "
                         "this converter does not write (fp32 and bf16 runs convert)")
    trainable = {name: record for name, record in manifest.params.items() if record.role == MASTER}
    for name, record in trainable.items():
        if record.whole_tensor or set(record.state) != set(ADAM_STATE) or "step" not in record.scalars:
            held = ", ".join(record.state) or "none (never stepped)"
            raise ValueError(f"{where}: {name!r} has optimizer state {held}; DeepSpeed's universal layout holds "
                             f"Adam's {' and '.join(ADAM_STATE)} and step (Adam, AdamW after a step)")
    steps = {float(_value(record.scalars["step"])) for record in trainable.values()}
    if len(steps) > 1:
        counts = ", ".join(f"{step:g}" for step in sorted(steps))
        raise ValueError(f"{where}: parameters were stepped {counts} times; DeepSpeed's universal layout keeps one "
                         "step count for all of them")
    return trainable


def _value(encoded: dict[str, Any]) -> Any:
    return decode_scalar(encoded, torch.device("cpu"))


# --- the tensors --------------------------------------------------------------------------------------

def read_whole(record: ParamRecord, key: str, readers: Readers) -> torch.Tensor:
    """Tensor `key` of a parameter (its values or one optimizer state), joined from the ranks' parts."""
    dtype = readers(rank_file(record.parts[0][0])).spec(key).dtype
    whole = torch.empty(record.numel, dtype=dtype)
    for rank, begin, end in record.parts:
        readers(rank_file(rank)).read_into(key, 0, whole[begin:end])
    return whole.view(record.shape)


def _write_params(zero: Path, manifest: Manifest, trainable: dict[str, ParamRecord],
                  readers: Readers) -> OrderedDict[str, torch.Tensor]:
    """Every trainable parameter's fp32.pt, moments and step.pt, one parameter in memory at a time, then an
    fp32.pt for every other state-dict key, as ds_to_universal writes them. Returns the model's state dict as
    DeepSpeed keeps `module`: parameters at the compute precision, frozen ones and buffers as saved."""
    param_dtype = dtype_of(manifest.param_dtype)
    values: dict[str, torch.Tensor] = {}
    for name, record in trainable.items():
        master = read_whole(record, values_key(name, MASTER), readers)
        _save(zero / name / "fp32.pt", {"param": master, "cat_dim": 0})
        for key in ADAM_STATE:
            _save(zero / name / f"{key}.pt", {"param": read_whole(record, state_key(key, name), readers), "cat_dim": 0})
        _save(zero / name / "step.pt", _value(record.scalars["step"]))
        values[name] = master.to(param_dtype)
    for name, record in manifest.params.items():
        if name not in trainable:
            values[name] = read_whole(record, values_key(name, record.role), readers)
    module = OrderedDict((key, values[name]) for key, name, _ in manifest.model["state_dict"])
    for key, tensor in module.items():
        if key not in trainable:
            _save(zero / key / "fp32.pt", {"param": tensor.float() if tensor.is_floating_point() else tensor})
    return module


def _partitioned(module: OrderedDict[str, torch.Tensor], buffers: set[str]) -> OrderedDict[str, torch.Tensor]:
    """A ZeRO-3 model file's `module`: every parameter an empty tensor (its values live in zero/), buffers whole."""
    return OrderedDict((key, tensor if key in buffers else torch.empty(0, dtype=tensor.dtype))
                       for key, tensor in module.items())


# --- the records --------------------------------------------------------------------------------------

def _groups(manifest: Manifest, trainable: dict[str, ParamRecord]) -> list[list[str]]:
    """Each param group's parameters in the model's order."""
    groups: list[list[str]] = [[] for _ in manifest.optimizers[0]["param_groups"]]
    for key, name, kind in manifest.model["state_dict"]:
        if key == name and name in trainable:
            groups[trainable[name].group].append(name)
    return groups


def _hyperparameters(saved: dict[str, Any]) -> dict[str, Any]:
    """A group's saved hyperparameters as torch keeps them (betas a tuple)."""
    return {key: tuple(value) if isinstance(value, list) else value for key, value in saved.items()}


def optimizer_state(manifest: Manifest, trainable: dict[str, ParamRecord]) -> dict[str, Any]:
    """zero/optimizer_state.pt. See [Note: one param group's hyperparameters at ZeRO-3]."""
    groups = [_hyperparameters(saved) for saved in manifest.optimizers[0]["param_groups"]]
    param_groups = [{**group, "params": [index]} for index, group in enumerate(groups)]
    common = {key: value for key, value in groups[0].items() if all(g.get(key, object()) == value for g in groups)}
    step = _value(next(iter(trainable.values())).scalars["step"])
    return {"zero_stage": manifest.stage, "partition_count": [manifest.world_size] * len(groups),
            "dynamic_loss_scale": False, "overflow": False,
            "clip_grad": float(manifest.config.get("gradient_clipping") or 0.0), "ds_version": LAYOUT_VERSION,
            "param_groups": param_groups,
            "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": [{**common, "params": [0]}]}}


def model_state(manifest: Manifest, trainable: dict[str, ParamRecord], module: OrderedDict[str, torch.Tensor],
                client_state: dict[str, Any], schedules: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The model-states file, as DeepSpeed's engine writes it (_common_checkpoint_state), with the client_state's
    keys beside its own."""
    progress, config = manifest.progress, manifest.config
    global_steps = int(progress["optimizer_step"]) + int(progress["total_skips"])
    frozen = [name for name, record in manifest.params.items() if record.role not in (MASTER, BUFFER)]
    state = {
        "module": module,
        "buffer_names": [key for key, name, kind in manifest.model["state_dict"] if kind == "buffer"],
        "optimizer": None,
        "param_shapes": [OrderedDict((name, torch.Size(trainable[name].shape)) for name in group)
                         for group in _groups(manifest, trainable)],
        "frozen_param_shapes": OrderedDict((name, torch.Size(manifest.params[name].shape)) for name in frozen),
        "shared_params": {key: name for key, name, kind in manifest.model["state_dict"]
                          if kind == "param" and key != name},
        "frozen_param_fragments": OrderedDict((name, module[name]) for name in frozen if name in module),
        "lr_scheduler": _lr_scheduler(schedules, manifest),
        "data_sampler": None, "random_ltd": None, "sparse_tensor_module_names": set(),
        "skipped_steps": int(progress["total_skips"]), "global_steps": global_steps,
        "global_samples": global_steps * int(config.get("train_batch_size") or 0),
        "dp_world_size": manifest.world_size, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": _ds_config(manifest), "ds_version": LAYOUT_VERSION,
    }
    return {**state, **{key: value for key, value in client_state.items() if key not in state}}


def _lr_scheduler(schedules: list[dict[str, Any]] | None, manifest: Manifest) -> dict[str, int] | None:
    """DeepSpeed's schedule state ({'last_batch_iteration'}, counted from -1): from the schedule zerokit.deepspeed
    saved (a torch scheduler's last_epoch, counted from 0), else, when the run's config has a `scheduler` block,
    from the optimizer steps (the engine steps its schedule once per step not skipped, as DeepSpeed does); None
    without a schedule, as DeepSpeed writes it."""
    if schedules:
        return {"last_batch_iteration": int(schedules[0]["last_epoch"]) - 1}
    if (manifest.config.get("scheduler") or {}).get("type"):
        return {"last_batch_iteration": int(manifest.progress["optimizer_step"]) - 1}
    return None


def _ds_config(manifest: Manifest) -> dict[str, Any]:
    config = manifest.config
    return {"train_batch_size": config.get("train_batch_size"),
            "train_micro_batch_size_per_gpu": config.get("train_micro_batch_size_per_gpu"),
            "gradient_accumulation_steps": config.get("gradient_accumulation_steps"),
            "gradient_clipping": config.get("gradient_clipping"),
            "zero_optimization": {"stage": manifest.stage},
            "bf16": {"enabled": manifest.param_dtype == "bfloat16"}}


def _save(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(value, path)
