"""A checkpoint saved by one layout (pipeline stages x data replicas x tensor ranks) loaded by another: a pipeline
into flat ZeRO and back, a tensor degree into another or none.

[Note: a checkpoint per stage and tensor rank, read as one]
An engine of a layout saves under `root/stage<s>/tensor<j>-of-<t>` (each level only where the layout has more than
one), a zerokit checkpoint of its own stage's pieces with the data group alone (See [Note: a checkpoint per tensor
rank] in parallel/tensor/setup.py), and its manifest records where it stood: the stage of how many, the tensor rank of
how many, the dimension each split parameter is cut on, and the parameters tied to copies on other stages. Where the
loading engine's layout is the saved one, each engine loads its own directory as any checkpoint (any data degree,
any ZeRO stage). Otherwise the parts are read as one checkpoint of the whole model: a parameter is the stage's that
holds it (its name as the whole model names it: torch's pipeline() tracer, DeepSpeed's PipelineModule and a
Sequential of named layers keep those names), its tensor pieces concatenated on their split dimension, and the
loading engine's piece cut from that whole on its own. The same goes for every element-wise optimizer state (Adam's
moments), so the run resumes as if it had never changed layout. A name on two stages must be a tied weight (its
copies are equal); otherwise the stages named their parameters locally ("0.weight" on each), and the load is refused.
The RNG states are the saving ranks' and are not restored into other ranks. A whole parameter is held in memory at a
time while it is cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerokit.checkpoint.files import Readers, TensorSpec
from zerokit.checkpoint.restore import read_range
from zerokit.checkpoint.locate import STAGE_DIR, TENSOR_DIR, checkpoint_directory
from zerokit.checkpoint.manifest import (MANIFEST, Manifest, ParamRecord, rank_file, read_manifest, state_dict_keys,
                                         state_key, values_key)
from zerokit.stages.view import persistent_buffers



def parallel_record(layout: Any, module: nn.Module, split: dict[int, int], tied: frozenset[str]
                    ) -> dict[str, Any]:
    """What a manifest records of the saving engine's place in its layout."""
    stage, _, tensor = layout.coordinates(dist.get_rank()) if layout is not None else (0, 0, 0)
    return {"stage": stage, "stages": layout.pipeline if layout is not None else 1, "tensor_rank": tensor,
            "tensors": layout.tensor if layout is not None else 1,
            "split": {name: split[id(p)] for name, p in module.named_parameters() if id(p) in split},
            "tied": sorted(tied)}


@dataclass
class Part:
    directory: Path  # the checkpoint of one stage and tensor rank (its tag's directory)
    manifest: Manifest
    stage: int
    tensor_rank: int
    tensors: int
    split: dict[str, int]
    tied: frozenset[str]
    readers: Readers

    @classmethod
    def open(cls, root: Path, tag: str | None) -> "Part":
        directory = checkpoint_directory(root, tag)
        manifest = read_manifest(directory)
        parallel = manifest.parallel or _parallel_from_path(root, directory)
        return cls(directory, manifest, parallel["stage"], parallel["tensor_rank"], parallel["tensors"],
                   parallel["split"], frozenset(parallel["tied"]), Readers(directory, manifest.files))

    def whole(self, name: str, key: str) -> torch.Tensor:
        """This part's tensor `key` of parameter `name`, in the part's shape (a piece where split)."""
        record = self.manifest.params[name]
        if record.whole_tensor and key.startswith("state/"):
            return self.readers(rank_file(record.parts[0][0])).read_tensor(key)
        dtype = self.readers(rank_file(record.parts[0][0])).spec(key).dtype
        out = torch.empty(record.shape, dtype=dtype)
        read_range(self.readers, record, key, 0, out)
        return out


def _parallel_from_path(root: Path, directory: Path) -> dict[str, Any]:
    """A manifest written before zerokit recorded the layout: the stage its directory names; a tensor-parallel part
    cannot say which dimension its pieces were cut on."""
    if TENSOR_DIR.match(root.name):
        raise ValueError(f"{directory / MANIFEST}: saved by a zerokit that did not record how tensor parallelism "
                         "cut its parameters; load it at the tensor degree it was saved with")
    stage = STAGE_DIR.match(root.name)
    return {"stage": int(stage.group(1)) if stage else 0, "tensor_rank": 0, "tensors": 1, "split": {}, "tied": []}


@dataclass(frozen=True)
class Target:
    """The piece of a whole tensor the loading engine holds: chunk `index` of `count` on dimension `dim` (None: the
    whole tensor)."""
    dim: int | None = None
    index: int = 0
    count: int = 1

    def cut(self, whole: torch.Tensor) -> torch.Tensor:
        return whole if self.dim is None else whole.chunk(self.count, self.dim)[self.index].contiguous()

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        return tuple(size // self.count if d == self.dim else size for d, size in enumerate(shape))


class Relayout:
    """The parts of a checkpoint saved per stage and tensor rank, read as one checkpoint of the whole model (See
    [Note: a checkpoint per stage and tensor rank, read as one])."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self.stages: dict[int, dict[int, Part]] = {}
        for part in parts:
            self.stages.setdefault(part.stage, {})[part.tensor_rank] = part
        self.owner: dict[str, int] = {}
        for stage in sorted(self.stages):
            part = self.first_of(stage)
            for name in part.manifest.params:
                if name in self.owner and not (name in part.tied and name in self.first_of(self.owner[name]).tied):
                    raise ValueError(f"{part.directory / MANIFEST}: {name!r} is on stages {self.owner[name]} and "
                                     f"{stage}, and not as a tied weight: the stage modules name their parameters "
                                     "locally; name them as the whole model does (torch's pipeline() and a "
                                     "Sequential of OrderedDict((str(index), layer)) keep those names), or load at "
                                     "the layout it was saved with")
                self.owner.setdefault(name, stage)

    @property
    def first(self) -> Part:
        return self.parts[0]

    def first_of(self, stage: int) -> Part:
        """The part of `stage`'s first tensor rank: where a replicated parameter and a piece's record are read."""
        ranks = self.stages[stage]
        return ranks[min(ranks)]

    def record(self, name: str) -> tuple[ParamRecord, tuple[int, ...], Part]:
        """The saved record of `name` (from the first tensor rank of its stage), its whole shape, and that part."""
        part = self.first_of(self.owner[name])
        record = part.manifest.params[name]
        dim = part.split.get(name)
        shape = list(record.shape)
        if dim is not None:
            shape[dim] *= part.tensors
        return record, tuple(shape), part

    def whole(self, name: str, key: str) -> torch.Tensor:
        """Tensor `key` (values or a state) of parameter `name`, whole: its stage's tensor pieces concatenated."""
        ranks, part = self.stages[self.owner[name]], self.first_of(self.owner[name])
        dim = part.split.get(name)
        if dim is None:
            return part.whole(name, key)
        if part.manifest.params[name].whole_tensor and key.startswith("state/"):
            raise ValueError(f"{part.directory / MANIFEST}: {name!r} is cut by tensor parallelism and its optimizer "
                             "state is per tensor, not per element; load it at the tensor degree it was saved with")
        missing = [j for j in range(part.tensors) if j not in ranks]
        if missing:
            raise ValueError(f"{part.directory.parent.parent}: tensor rank {missing[0]} of {part.tensors} of stage "
                             f"{part.stage} is missing")
        return torch.cat([ranks[j].whole(name, key) for j in range(part.tensors)], dim=dim)

    def close(self) -> None:
        for part in self.parts:
            part.readers.close()


class CutFile:
    """One parameter's tensors (values and optimizer state) as the loading engine holds them, seen as a rank file
    that holds that parameter alone, whole: what restore.py and consolidate.py read from."""

    def __init__(self, relayout: Relayout, name: str, target: Target) -> None:
        self.relayout, self.name, self.target = relayout, name, target
        self.cache: dict[str, torch.Tensor] = {}

    @property
    def tensors(self) -> dict[str, None]:
        record, _, _ = self.relayout.record(self.name)
        keys = [values_key(self.name, record.role)] + [state_key(key, self.name) for key in record.state]
        return {key: None for key in keys}

    def _cut(self, key: str) -> torch.Tensor:
        if key not in self.cache:
            self.cache = {key: self.target.cut(self.relayout.whole(self.name, key))}  # one tensor held at a time
        return self.cache[key]

    def spec(self, key: str) -> TensorSpec:
        tensor = self._cut(key)
        return TensorSpec(key, tensor.dtype, tuple(tensor.shape))

    def read_into(self, key: str, begin: int, out: torch.Tensor) -> None:
        out.view(-1).copy_(self._cut(key).reshape(-1).narrow(0, begin, out.numel()))

    def read_elements(self, key: str, begin: int, end: int) -> torch.Tensor:
        return self._cut(key).reshape(-1)[begin:end].clone()

    def read_tensor(self, key: str) -> torch.Tensor:
        return self._cut(key).clone()


class CutReaders:
    """Readers over a Relayout: file `rank_file(i)` is the i-th parameter's CutFile."""

    def __init__(self, relayout: Relayout, files: list[CutFile]) -> None:
        self.relayout, self.directory = relayout, relayout.first.directory
        self.files = {rank_file(index): file for index, file in enumerate(files)}

    def __call__(self, name: str) -> CutFile:
        return self.files[name]

    def close(self) -> None:
        self.relayout.close()


@dataclass
class RelayoutSource:
    """A checkpoint of another layout ready for restore.py, as the loading engine holds the model: the manifest and
    readers it reads through, and the directory holding the saving run's counters, schedules and client_state."""
    directory: Path
    manifest: Manifest
    readers: CutReaders


def open_relayout(parts: list[Path], tag: str | None, module: nn.Module, targets: dict[str, Target]
                  ) -> RelayoutSource:
    """The checkpoint whose parts are `parts` as `module` holds it: every parameter and persistent buffer of
    `module`, cut as `targets` says (a name not there: whole). Raises ValueError (one line) where the model differs
    or the parts do not make a whole."""
    relayout = Relayout([Part.open(path, tag) for path in parts])
    try:
        names = [name for name, _ in module.named_parameters()] + [name for name, _ in persistent_buffers(module)]
        shapes = {name: tuple(t.shape) for name, t in [*module.named_parameters(), *persistent_buffers(module)]}
        return _source(relayout, names, shapes, targets, state_dict_keys(module))
    except BaseException:
        relayout.close()
        raise


def open_whole(parts: list[Path], tag: str | None) -> RelayoutSource:
    """The checkpoint whose parts are `parts` as one model holds it, whole: for consolidation."""
    relayout = Relayout([Part.open(path, tag) for path in parts])
    keys, seen = [], set()
    for stage in sorted(relayout.stages):
        for entry in relayout.first_of(stage).manifest.model["state_dict"]:
            if entry[0] not in seen:
                seen.add(entry[0])
                keys.append(entry)
    names = list(dict.fromkeys(name for _, name, _ in keys))
    return _source(relayout, names, None, {}, keys)


def _source(relayout: Relayout, names: list[str], shapes: dict[str, tuple[int, ...]] | None,
            targets: dict[str, Target], keys: list[list[str]]) -> RelayoutSource:
    first = relayout.first
    where = first.directory / MANIFEST
    records, files = {}, []
    for index, name in enumerate(names):
        if name not in relayout.owner:
            raise ValueError(f"{where}: from another model ({first.manifest.model['class']}): no values for {name!r} "
                             f"on any of its {len(relayout.parts)} part(s)")
        saved, whole_shape, _ = relayout.record(name)
        target = targets.get(name, Target())
        shape = target.shape(whole_shape)
        if shapes is not None and shape != shapes[name]:
            raise ValueError(f"{where}: from another model ({first.manifest.model['class']}): {name!r} is "
                             f"{whole_shape} whole there, so {shape} here, but this model's is {shapes[name]}")
        records[name] = replace(saved, shape=shape, parts=[(index, 0, math.prod(shape))])
        files.append(CutFile(relayout, name, target))
    manifest = replace(first.manifest, params=records, files={}, rng={},
                       model={**first.manifest.model, "state_dict": keys}, parallel=None)
    return RelayoutSource(first.directory, manifest, CutReaders(relayout, files))


def targets_of(module: nn.Module, split: dict[int, int], tensor_rank: int, tensors: int) -> dict[str, Target]:
    """How the loading engine cuts each of its split parameters (id -> dimension in `split`)."""
    return {name: Target(split[id(p)], tensor_rank, tensors) for name, p in module.named_parameters()
            if id(p) in split}


__all__ = ["Relayout", "RelayoutSource", "Target", "open_relayout", "open_whole", "parallel_record", "targets_of"]
