"""Sharded flat parameters (stage 3): this rank keeps its shard of every bucket; a bucket is whole only
while gathered. One class serves the trainable parameters and the frozen ones alike.

Between gathers a parameter keeps its true shape and dtype (no torch.Size([0]) surprise): its data is
one NaN broadcast to that shape, so code that computes with it outside its unit's forward gets NaN
(and zerokit skips and reports the step) rather than plausible zeros, and code that writes to it in
place gets an error. Gather with engine.unsharded() first.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zerokit.comm import Communicator, Pending, wait
from zerokit.flat.buffers import FlatParameters, own_part, tensor_bytes
from zerokit.flat.layout import Bucket, RankShards


class ShardHome(Protocol):
    """Where the shards live between gathers: zerokit/tiers/shards.py."""

    tier: str

    def allocate(self, local: RankShards, dtype: torch.dtype) -> torch.Tensor: ...
    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor: ...
    def write(self, shard: torch.Tensor, values: torch.Tensor, source: str) -> None: ...
    def held(self, shards: torch.Tensor) -> dict[str, int]: ...


class ShardedFlat:
    def __init__(self, flat: FlatParameters, rank: int, home: ShardHome) -> None:
        self.flat = flat
        self.layout = flat.layout
        self.rank = rank
        self.home = home
        self.local = self.layout.shards_of(rank)
        # 1-D, param dtype: this rank's shard of every bucket, back to back (See FlatLayout.shards_of).
        self.shards = home.allocate(self.local, flat.dtype)
        self.placeholder = torch.full((1,), float("nan"), dtype=flat.dtype, device=flat.device)
        self.full: dict[int, torch.Tensor] = {}  # bucket index -> the gathered bucket (1-D), while gathered
        self.in_flight: dict[int, Pending] = {}  # bucket index -> its gather, until waited on

    def shard(self, bucket: Bucket) -> torch.Tensor:
        return self.local.view(self.shards, bucket)

    def keep_shard(self, bucket: Bucket, values: torch.Tensor) -> torch.Tensor:
        """Keep this rank's part of `values` (the whole bucket, 1-D, any dtype) as its shard; returns
        that part of `values` itself, so the caller can keep it at full precision."""
        own = own_part(values, bucket, self.rank)
        self.home.write(self.shard(bucket), own, "device")
        return own

    # --- gather and free ----------------------------------------------------------------------------
    def gather(self, bucket: Bucket, comm: Communicator, purpose: str = "") -> int:
        """Start gathering the bucket (asynchronously); returns the elements that became live (0 if it
        was gathered or on its way already). `wait` before pointing parameters at it."""
        if bucket.index in self.full:
            return 0
        full = torch.empty(bucket.numel, dtype=self.flat.dtype, device=self.flat.device)
        source = self.home.fetch(self.shard(bucket), own_part(full, bucket, self.rank))
        self.in_flight[bucket.index] = gather_bucket(comm, bucket, full, source, async_op=True, purpose=purpose)
        self.full[bucket.index] = full
        return bucket.numel

    def wait(self, bucket: Bucket) -> None:
        if bucket.index in self.in_flight:
            wait(self.in_flight.pop(bucket.index))

    def has(self, bucket: Bucket) -> bool:
        """Gathered, or being gathered."""
        return bucket.index in self.full

    def ready(self, bucket: Bucket) -> bool:
        return bucket.index in self.full and bucket.index not in self.in_flight

    def point(self, bucket: Bucket) -> None:
        self.flat.point(bucket, self.full[bucket.index])

    def free(self, bucket: Bucket) -> int:
        """Drop the gathered bucket (once its gather is done); returns the elements freed. The parameters
        still view it until `release`."""
        self.wait(bucket)
        return bucket.numel if self.full.pop(bucket.index, None) is not None else 0

    def release(self, bucket: Bucket) -> None:
        self.flat.release(bucket, self.placeholder)

    def regather(self, bucket: Bucket, comm: Communicator, purpose: str = "") -> None:
        """Refresh a gathered bucket from the shards (after the shards changed), in place."""
        if bucket.index in self.full:
            self.wait(bucket)
            full = self.full[bucket.index]
            source = self.home.fetch(self.shard(bucket), own_part(full, bucket, self.rank))
            wait(gather_bucket(comm, bucket, full, source, purpose=purpose))

    def write_back(self, bucket: Bucket) -> torch.Tensor | None:
        """Keep in-place edits of a gathered bucket: this rank's part goes back to its shard, and is
        returned (None when the bucket is not gathered)."""
        if not self.ready(bucket):
            return None
        return self.keep_shard(bucket, self.full[bucket.index])

    def tensors(self) -> list[torch.Tensor]:
        """What this holds in memory: the shards, and the gathered buckets."""
        return [self.shards, *self.full.values()]

    def held_by_tier(self) -> dict[str, int]:
        """Bytes by tier: the shards where their home keeps them, the gathered buckets on the device."""
        held = {"device": tensor_bytes(self.full.values())}
        for tier, count in self.home.held(self.shards).items():
            held[tier] = held.get(tier, 0) + count
        return held


def gather_bucket(comm: Communicator, bucket: Bucket, full: torch.Tensor, shard: torch.Tensor,
                  async_op: bool = False, purpose: str = "") -> Pending:
    """`full` (the whole bucket, 1-D) from every rank's `shard` of it: an all-gather, or for a bucket owned
    by one rank a broadcast from it (See [Note: buckets owned by one rank]). `purpose`: named in reports."""
    if bucket.owner is None:
        return comm.all_gather(full, shard, async_op=async_op, purpose=purpose)
    if comm.rank == bucket.owner and full.data_ptr() != shard.data_ptr():
        full.copy_(shard)
    return comm.broadcast(full, src=bucket.owner, async_op=async_op, purpose=purpose)
