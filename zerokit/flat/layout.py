"""Shard arithmetic: where each parameter lives in the flat buffer, bucket by bucket.

[Note: buckets are the unit of sharding]
Trainable parameters are packed into one flat 1-D buffer made of buckets. A bucket holds whole
parameters of one optimizer param group, is padded with zeros to a multiple of the world size N,
and is split into N equal shards; rank r owns shard r of *every* bucket. (Megatron's distributed
optimizer does the same.) Sharding per bucket rather than per buffer means one bucket's gradients
can be reduce-scattered the moment they are ready and land directly in their owners' shards.

Buckets are laid out in the order backward is expected to finish them: parameters are taken in
reverse registration order, and a bucket is complete when its last parameter's gradient arrives.
Every rank launches bucket reductions strictly in this order, so ranks issue collectives in the
same sequence even when a data-dependent branch leaves some parameters without gradients.

Each rank keeps its shard of every bucket back to back in one 1-D shard buffer (stages 2-3: gradient
shards; stage 3: parameter shards), bucket b's shard at `b.local_start`. Every offset into a flat
buffer, a bucket, a shard or a shard buffer is computed here and nowhere else.

This module is pure arithmetic (no tensors, no process group) so it is tested at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence


class ParamEntry(NamedTuple):
    """What the layout needs to know of one parameter. A plain (numel, group) tuple is one too."""

    numel: int
    group: int  # parameters share a bucket only with their group (optimizer param group; stage 3: and unit)
    name: str = ""  # its state-dict name (the first, for a tied parameter)
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer, and which parameter it is (for checkpoint manifests)."""

    param_index: int  # index into the parameter list the layout was built from
    offset: int  # first element in the flat buffer
    numel: int
    name: str = ""
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Bucket:
    index: int  # position in launch order
    group: int  # the key its parameters share (optimizer param group; at stage 3 also the unit)
    start: int  # first element in the flat buffer
    numel: int  # padded size, a multiple of world_size
    slots: tuple[Slot, ...]
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    @property
    def end(self) -> int:
        return self.start + self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat-buffer [begin, end) of rank's shard of this bucket."""
        begin = self.start + rank * self.shard_numel
        return begin, begin + self.shard_numel

    def shard_in_bucket(self, rank: int) -> tuple[int, int]:
        """[begin, end) of rank's shard within the bucket itself (a tensor of the bucket alone)."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    @property
    def local_start(self) -> int:
        """Where this bucket's shard begins in a rank's shard buffer (every bucket's shard, back to back)."""
        return self.start // self.world_size

    @property
    def local_range(self) -> tuple[int, int]:
        return self.local_start, self.local_start + self.shard_numel

    def slot_range(self, slot: Slot) -> tuple[int, int]:
        """[begin, end) of a parameter within the bucket itself."""
        return slot.offset - self.start, slot.offset - self.start + slot.numel


@dataclass(frozen=True)
class FlatLayout:
    buckets: tuple[Bucket, ...]
    world_size: int

    @property
    def numel(self) -> int:
        """Total padded elements; every rank's shards together hold numel / world_size."""
        return sum(bucket.numel for bucket in self.buckets)

    @property
    def data_numel(self) -> int:
        return sum(slot.numel for bucket in self.buckets for slot in bucket.slots)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _group_into_buckets(params: Sequence[ParamEntry], bucket_numel: int) -> list[list[int]]:
    """Greedy, per param group, in backward order: close a bucket once it reaches bucket_numel."""
    open_bucket: dict[int, list[int]] = {}
    open_size: dict[int, int] = {}
    closed: list[list[int]] = []
    for index, (numel, group, *_) in enumerate(params):
        open_bucket.setdefault(group, []).append(index)
        open_size[group] = open_size.get(group, 0) + numel
        if open_size[group] >= bucket_numel:
            closed.append(open_bucket.pop(group))
            open_size[group] = 0
    closed.extend(open_bucket.values())
    # Launch order = the order buckets complete in backward: by their last parameter.
    return sorted(closed, key=max)


def build_layout(params: Sequence[ParamEntry | tuple[int, int]], world_size: int, bucket_numel: int) -> FlatLayout:
    """Lay out parameters (ParamEntry, or (numel, group) pairs) in expected backward order."""
    params = [ParamEntry(*param) for param in params]
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if bucket_numel < 1:
        raise ValueError(f"bucket size of {bucket_numel} elements must be >= 1")
    buckets: list[Bucket] = []
    start = 0
    for index, members in enumerate(_group_into_buckets(params, bucket_numel)):
        slots, offset = [], start
        for param_index in members:
            entry = params[param_index]
            slots.append(Slot(param_index, offset, entry.numel, entry.name, tuple(entry.shape)))
            offset += entry.numel
        padded = round_up(max(offset - start, 1), world_size)
        buckets.append(Bucket(index, params[members[0]].group, start, padded, tuple(slots), world_size))
        start += padded
    return FlatLayout(tuple(buckets), world_size)
