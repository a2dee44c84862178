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

This module is pure arithmetic (no tensors, no process group) so it is tested at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer."""

    param_index: int  # index into the parameter list the layout was built from
    offset: int  # first element in the flat buffer
    numel: int


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


def _group_into_buckets(params: Sequence[tuple[int, int]], bucket_numel: int) -> list[list[int]]:
    """Greedy, per param group, in backward order: close a bucket once it reaches bucket_numel."""
    open_bucket: dict[int, list[int]] = {}
    open_size: dict[int, int] = {}
    closed: list[list[int]] = []
    for index, (numel, group) in enumerate(params):
        open_bucket.setdefault(group, []).append(index)
        open_size[group] = open_size.get(group, 0) + numel
        if open_size[group] >= bucket_numel:
            closed.append(open_bucket.pop(group))
            open_size[group] = 0
    closed.extend(open_bucket.values())
    # Launch order = the order buckets complete in backward: by their last parameter.
    return sorted(closed, key=max)


def build_layout(params: Sequence[tuple[int, int]], world_size: int, bucket_numel: int) -> FlatLayout:
    """Lay out parameters given as (numel, param group) in expected backward order."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if bucket_numel < 1:
        raise ValueError(f"bucket size of {bucket_numel} elements must be >= 1")
    buckets: list[Bucket] = []
    start = 0
    for index, members in enumerate(_group_into_buckets(params, bucket_numel)):
        slots, offset = [], start
        for param_index in members:
            numel = params[param_index][0]
            slots.append(Slot(param_index, offset, numel))
            offset += numel
        padded = round_up(max(offset - start, 1), world_size)
        buckets.append(Bucket(index, params[members[0]][1], start, padded, tuple(slots), world_size))
        start += padded
    return FlatLayout(tuple(buckets), world_size)
