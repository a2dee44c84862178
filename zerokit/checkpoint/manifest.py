"""The manifest: one JSON file per checkpoint that says what every rank file holds, written by rank 0 only
after every rank has written its file (so its presence means the checkpoint is whole).

[Note: a checkpoint is per parameter, not per rank]
A rank file holds, for each parameter part the rank owns, the fp32 master values of that part and its
optimizer state, keyed by the parameter's name: `param/<name>` and `state/<key>/<name>` (per-element
state of an element-wise optimizer covers the same elements; a whole-tensor optimizer's state is whole).
The manifest lists, per parameter, which rank file holds which element range [begin, end) of the
flattened parameter, and the optimizer's per-parameter scalars (`step`), which are equal for all parts.
Buckets, padding, shard sizes and optimizer pieces are the saving run's business and appear nowhere in
what a loader needs, so a run with another world size, stage, bucket size or sub_group_size reads the
ranges its own pieces need and nothing else. (The saving layout is recorded too, for people.)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerokit.checkpoint.files import FileRecord

FORMAT = "zerokit.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
CLIENT_STATE = "client_state.pt"
LR_SCHEDULES = "lr_schedules.pt"  # the state of the LR schedules the engine steps (a list, one per schedule)
MASTER, FROZEN, BUFFER = "master", "frozen", "buffer"  # what a parameter record's values are


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def values_key(name: str, role: str) -> str:
    return f"{'buffer' if role == BUFFER else 'param'}/{name}"


def state_key(key: str, name: str) -> str:
    return f"state/{key}/{name}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a checkpoint manifest")
    return dtype


@dataclass
class PartRecord:
    """One rank's part of one parameter (or buffer): elements [begin, end) of it, flattened."""

    name: str
    role: str  # MASTER (fp32 masters of a trainable parameter), FROZEN (compute dtype), BUFFER
    dtype: str
    shape: tuple[int, ...]
    rank: int
    begin: int
    end: int
    optimizer: int | None = None  # index of the user's optimizer, and its param group
    group: int | None = None
    whole_tensor: bool = False
    state: tuple[str, ...] = ()  # tensors of optimizer state saved beside the values (none: never stepped)
    scalars: dict[str, Any] = field(default_factory=dict)  # per-parameter optimizer scalars, encoded


@dataclass
class ParamRecord:
    """Everything about one parameter or buffer, merged from the ranks' parts."""

    role: str
    dtype: str
    shape: tuple[int, ...]
    parts: list[tuple[int, int, int]]  # (rank, begin, end), sorted by begin
    optimizer: int | None = None
    group: int | None = None
    whole_tensor: bool = False
    state: tuple[str, ...] = ()
    scalars: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class RankReport:
    """What one rank wrote (sent to rank 0 once its file is on disk), or why it could not."""

    rank: int
    file: FileRecord | None
    parts: list[PartRecord]
    rng: dict[str, Any]
    error: str | None = None


@dataclass
class Manifest:
    tag: str
    world_size: int
    stage: int
    param_dtype: str
    zerokit_version: str
    model: dict[str, Any]  # class, state_dict keys in order (each: key, the parameter or buffer it is), hf_config
    params: dict[str, ParamRecord]  # parameters and persistent buffers, by (canonical) name
    optimizers: list[dict[str, Any]]  # class, kind, param_groups (hyperparameters, no params)
    progress: dict[str, Any]
    loss_scaler: dict[str, Any]
    files: dict[str, FileRecord]
    rng: dict[int, dict[str, Any]]
    config: dict[str, Any]
    layout: list[dict[str, Any]]
    client_state: str | None = None
    lr_schedules: str | None = None
    data_position: str | None = None  # every rank's data position (See checkpoint/data_position.py); None: none saved
    parallel: dict[str, Any] | None = None  # the saving engine's place in its layout (See relayout.py); None: flat
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = [record.to_json() for record in self.files.values()]
        data["rng"] = {str(rank): value for rank, value in self.rng.items()}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Manifest":
        data = dict(data)
        data["files"] = {item["name"]: FileRecord.from_json(item) for item in data["files"]}
        data["rng"] = {int(rank): value for rank, value in data["rng"].items()}
        data["params"] = {name: ParamRecord(**{**record, "shape": tuple(record["shape"]),
                                               "state": tuple(record["state"]),
                                               "parts": [tuple(part) for part in record["parts"]]})
                          for name, record in data["params"].items()}
        return cls(**data)


def state_dict_keys(module: torch.nn.Module) -> list[list[str]]:
    """The model's state-dict keys in order, each with the parameter or buffer it is (a tied parameter: its first
    name) and which of the two."""
    first_name = {id(p): name for name, p in module.named_parameters()}
    return [[key, first_name.get(id(value), key), "param" if id(value) in first_name else "buffer"]
            for key, value in module.state_dict(keep_vars=True).items() if isinstance(value, torch.Tensor)]


def merge_parts(reports: list[RankReport]) -> dict[str, ParamRecord]:
    """Every rank's parts, one record per parameter, checked: the parts tile the parameter, and every part
    agrees on its optimizer, its state keys and its scalars."""
    records: dict[str, ParamRecord] = {}
    for report in reports:
        for part in report.parts:
            record = records.setdefault(part.name, ParamRecord(
                part.role, part.dtype, tuple(part.shape), [], part.optimizer, part.group, part.whole_tensor,
                tuple(part.state), dict(part.scalars)))
            same = (record.role, record.dtype, record.optimizer, record.group, record.state, record.scalars) == (
                part.role, part.dtype, part.optimizer, part.group, tuple(part.state), part.scalars)
            if not same:
                raise RuntimeError(f"rank {part.rank}'s part of {part.name!r} disagrees with another rank's about its "
                                   "optimizer state (an internal bug)")
            record.parts.append((part.rank, part.begin, part.end))
    for name, record in records.items():
        record.parts.sort(key=lambda p: p[1])
        covered = 0
        for _, begin, end in record.parts:
            if begin != covered:
                raise RuntimeError(f"the saved parts of {name!r} do not tile it: a gap or overlap at element {covered} "
                                   "(an internal bug)")
            covered = end
        if covered != record.numel:
            raise RuntimeError(f"the saved parts of {name!r} cover {covered} of {record.numel} elements "
                               "(an internal bug)")
    return records


def read_manifest(directory: Path) -> Manifest:
    """The manifest of the checkpoint in `directory`, checked for format and version."""
    path = directory / MANIFEST
    if not path.is_file():
        partial = sorted(p.name for p in directory.parent.glob(f".{directory.name}.partial-*"))
        why = f" (an interrupted save left {partial[0]})" if partial else ""
        raise ValueError(f"{path}: missing: {directory} is not a complete zerokit checkpoint{why}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: corrupted: not valid JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a zerokit checkpoint manifest "
                         f"(format {data.get('format') if isinstance(data, dict) else None!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: checkpoint format version {data.get('version')!r} (written by zerokit "
                         f"{data.get('zerokit_version')}); this zerokit reads version {VERSION}")
    try:
        return Manifest.from_json(data)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: corrupted: a field is missing or malformed ({error})") from None
