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
shards; stage 3: parameter shards): `FlatLayout.shards_of(rank)` says where. Every offset into a flat
buffer, a bucket, a shard or a shard buffer is computed here and nowhere else.

[Note: buckets owned by one rank]
An optimizer that looks at whole tensors (Muon, Adafactor) cannot step a slice of one. Its parameters
go into buckets of their own, each owned whole by one rank (`Bucket.owner`): the owner's shard is the
whole bucket, every other rank's is empty. Its gradients are reduced to the owner, the owner steps
whole tensors, and the updated bucket is broadcast from it: as many bytes as a reduce-scatter and an
all-gather of it. Tensors are given to owners largest first, each to the least loaded rank
(`assign_owners`), so each rank holds about 1/N of them; an owned bucket needs no padding.

This module is pure arithmetic (no tensors, no process group) so it is tested at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:
    import torch


class ParamEntry(NamedTuple):
    """What the layout needs to know of one parameter. A plain (numel, group) tuple is one too."""

    numel: int
    group: int  # parameters share a bucket only with their group (optimizer param group; stage 3: and unit)
    name: str = ""  # its state-dict name (the first, for a tied parameter)
    shape: tuple[int, ...] = ()
    owner: int | None = None  # the rank that owns it whole (See [Note: buckets owned by one rank]); None: sharded


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
    numel: int  # padded size: a multiple of world_size, unless owned
    slots: tuple[Slot, ...]
    world_size: int
    owner: int | None = None  # None: split evenly over the ranks; else the rank that owns it whole

    @property
    def end(self) -> int:
        return self.start + self.numel

    def shard_in_bucket(self, rank: int) -> tuple[int, int]:
        """[begin, end) of rank's shard within the bucket itself (a tensor of the bucket alone)."""
        if self.owner is not None:
            return (0, self.numel) if rank == self.owner else (0, 0)
        size = self.numel // self.world_size
        return rank * size, (rank + 1) * size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat-buffer [begin, end) of rank's shard of this bucket."""
        begin, end = self.shard_in_bucket(rank)
        return self.start + begin, self.start + end

    def shard_size(self, rank: int) -> int:
        begin, end = self.shard_in_bucket(rank)
        return end - begin

    def slot_range(self, slot: Slot) -> tuple[int, int]:
        """[begin, end) of a parameter within the bucket itself."""
        return slot.offset - self.start, slot.offset - self.start + slot.numel

    def param_slices(self, rank: int) -> list["ParamSlice"]:
        """The parts of parameters that rank's shard of this bucket holds, in shard coordinates."""
        own_begin, own_end = self.shard_in_bucket(rank)
        slices = []
        for slot in self.slots:
            begin, end = self.slot_range(slot)
            begin, end = max(begin, own_begin), min(end, own_end)
            if begin < end:
                slices.append(ParamSlice(slot.param_index, begin - own_begin, end - own_begin,
                                         end - begin == slot.numel, slot.shape, begin - self.slot_range(slot)[0]))
        return slices


class ParamSlice(NamedTuple):
    """The part of one parameter in a rank's shard of a bucket."""

    param_index: int
    begin: int  # [begin, end) within the shard
    end: int
    whole: bool  # the shard holds the whole parameter
    shape: tuple[int, ...]
    param_begin: int  # where the part begins within the (flattened) parameter


@dataclass(frozen=True)
class RankShards:
    """Where each bucket's shard lies in one rank's shard buffer (every bucket's shard, back to back)."""

    rank: int
    ranges: tuple[tuple[int, int], ...]  # by bucket index
    numel: int  # the shard buffer's size

    def view(self, shards: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        begin, end = self.ranges[bucket.index]
        return shards[begin:end]


@dataclass(frozen=True)
class FlatLayout:
    buckets: tuple[Bucket, ...]
    world_size: int

    @property
    def numel(self) -> int:
        """Total padded elements; every rank's shards together hold all of them."""
        return sum(bucket.numel for bucket in self.buckets)

    @property
    def data_numel(self) -> int:
        return sum(slot.numel for bucket in self.buckets for slot in bucket.slots)

    @property
    def shard_numel(self) -> int:
        """Elements in each rank's shards when every bucket is split evenly (See shards_of otherwise)."""
        if any(bucket.owner is not None for bucket in self.buckets):
            raise ValueError("a layout with owned buckets has a different shard size on each rank; use shards_of(rank)")
        return self.numel // self.world_size

    def shards_of(self, rank: int) -> RankShards:
        ranges, begin = [], 0
        for bucket in self.buckets:
            ranges.append((begin, begin + bucket.shard_size(rank)))
            begin += bucket.shard_size(rank)
        return RankShards(rank, tuple(ranges), begin)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def assign_owners(sizes: Sequence[int], world_size: int) -> list[int]:
    """An owner rank for each tensor: largest first, each to the least loaded rank (the lowest on a tie),
    so that every rank holds about 1/world_size of the elements. Deterministic: every rank agrees."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(world_size), key=lambda rank: (load[rank], rank))
        owners[index] = owner
        load[owner] += sizes[index]
    return owners


def _group_into_buckets(params: Sequence[ParamEntry], bucket_numel: int) -> list[list[int]]:
    """Greedy, per param group and owner, in backward order: close a bucket once it reaches bucket_numel."""
    open_bucket: dict[tuple[int, int | None], list[int]] = {}
    open_size: dict[tuple[int, int | None], int] = {}
    closed: list[list[int]] = []
    for index, entry in enumerate(params):
        key = (entry.group, entry.owner)
        open_bucket.setdefault(key, []).append(index)
        open_size[key] = open_size.get(key, 0) + entry.numel
        if open_size[key] >= bucket_numel:
            closed.append(open_bucket.pop(key))
            open_size[key] = 0
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
        first = params[members[0]]
        padded = max(offset - start, 1) if first.owner is not None else round_up(max(offset - start, 1), world_size)
        buckets.append(Bucket(index, first.group, start, padded, tuple(slots), world_size, first.owner))
        start += padded
    return FlatLayout(tuple(buckets), world_size)
