"""Sharded flat parameters (stage 3): this rank keeps its shard of every bucket; a bucket is whole only
while gathered. One class serves the trainable parameters and the frozen ones alike.

Between gathers a parameter keeps its true shape and dtype (no torch.Size([0]) surprise): its data is
one NaN broadcast to that shape, so code that computes with it outside its unit's forward gets NaN
(and zerokit skips and reports the step) rather than plausible zeros, and code that writes to it in
place gets an error. Gather with engine.unsharded() first.

[Note: hpZ's secondary copy]
With `zero_hpz_partition_size: k` (ZeRO++ hpZ, stage 3) a bucket's primary shards stay over every rank, and the
first gather of a bucket after its shards change (the first forward of a step) also keeps a secondary shard: this
rank's 1/k of the whole bucket, the part its index in its node group of k consecutive ranks owns. Every later
gather of the bucket (backward, recomputation, later micro-steps, another rank's request) is an all-gather of
those secondary shards inside the node group. The secondary copy is dropped whenever the shards change: after
each optimizer step, after a checkpoint load, after edits written back (See `drop_secondary`), so it is never
stale. Whether a bucket has one is decided when a gather is issued (not when it completes) and follows only
from the gathers issued, which every rank issues alike: so every rank picks the same group for each gather.
Buckets owned by one rank (broadcast, not gathered) keep no secondary copy.

[Note: one buffer per bucket, freed in place]
Each bucket is gathered into the same tensor every time, and freed by shrinking that tensor's storage to nothing
(`free`), not by letting go of the tensor. Letting go freed nothing while something else still held the tensor:
autograd keeps the views of a parameter that a forward saved (a transposed weight, a LoRA base layer's `weight.T`)
until the backward, and so the whole bucket gathered for the forward; and zerokit's deadline watcher kept the torch
work of each gather, and with it the bucket, for up to a second (See [Note: a waited collective lets go of its
tensors] in comm/deadline.py). On an H200, after a stage-3 step of 33.6M fp32 parameters on one rank, 537 MB of
gathered buckets were still allocated beside the 537 MB of model states (tests/test_cuda.py); with shrinking, 268 MB
were (the size of the step's gradient buckets, which the watcher held too). Shrinking frees the memory
whoever holds the tensor, and growing the same storage back at the next gather means that a view saved in the
forward reads what was gathered again for the backward (FSDP2 treats its unsharded parameters alike). Shrinking
waits for the bucket's gather first, and the device reuses the memory only after it.

[Note: the shard is the fp32 master]
With a 16-bit compute dtype and the optimizer on the device, a rank would keep two copies of its trainable shard:
the fp32 master the optimizer steps and its 16-bit cast that the gathers read (2 bytes a parameter over N). FSDP2
keeps one: its sharded parameter is fp32 and each all-gather's input is cast from it. zerokit does the same there:
the trainable shards are kept in fp32 (`shard_dtype`) and are the masters themselves (See [Note: masters that alias
the compute shard] in zerokit/tiers/homes.py), and each gather casts this rank's part into its slot of the 16-bit
buffer it gathers into (DeviceShards.fetch), the slot the all-gather reads in place. The values gathered are those
the kept cast held: it was made from the same master after each step. An edit written back from a gathered bucket
changes only the elements it edited (`copy_edits`), as a separate master does. On an H200 (336.9M parameters,
one rank, bf16) this took 643 MiB off stage 3's states (benchmarks/gpu_check.py).
"""

from __future__ import annotations

from typing import ContextManager, Protocol

import torch

from zerokit.comm import Communicator, Pending, wait
from zerokit.flat.buffers import FlatParameters, copy_edits, own_part, tensor_bytes
from zerokit.flat.layout import Bucket, RankShards


class ShardHome(Protocol):
    """Where the shards live between gathers: zerokit/tiers/shards.py."""

    tier: str

    def allocate(self, local: RankShards, dtype: torch.dtype) -> torch.Tensor: ...
    def issuing(self) -> ContextManager[None]: ...
    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor: ...
    def write(self, shard: torch.Tensor, values: torch.Tensor, source: str) -> None: ...
    def held(self, shards: torch.Tensor) -> dict[str, int]: ...


class ShardedFlat:
    def __init__(self, flat: FlatParameters, rank: int, home: ShardHome, node: Communicator | None = None,
                 shard_dtype: torch.dtype | None = None) -> None:
        """`node`: hpZ's group of the k ranks that split a secondary copy (See [Note: hpZ's secondary copy]);
        `shard_dtype`: what the shards are kept in, if not the compute dtype (See [Note: the shard is the fp32
        master])."""
        self.flat = flat
        self.node = node
        self.secondary: dict[int, torch.Tensor] = {}  # bucket index -> this rank's 1/k of it (1-D), or pending
        self.capturing: set[int] = set()  # buckets whose secondary part is taken from their gather when it is done
        self.layout = flat.layout
        self.rank = rank
        self.home = home
        self.local = self.layout.shards_of(rank)
        # 1-D, shard dtype: this rank's shard of every bucket, back to back (See FlatLayout.shards_of).
        self.shards = home.allocate(self.local, shard_dtype or flat.dtype)
        self.shards_are_masters = self.shards.dtype != flat.dtype  # See [Note: the shard is the fp32 master]
        self.placeholder = torch.full((1,), float("nan"), dtype=flat.dtype, device=flat.device)
        self.buffers: dict[int, torch.Tensor] = {}  # bucket index -> what it is gathered into, each time (See Note)
        self.gathered: set[int] = set()  # buckets whose buffer holds them (or is being gathered into)
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
        if bucket.index in self.gathered:
            return 0
        full = self._grown(bucket)
        self.in_flight[bucket.index] = self._gather_into(full, bucket, comm, purpose, async_op=True)
        self.gathered.add(bucket.index)
        return bucket.numel

    def _grown(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's own buffer with its memory back (See [Note: one buffer per bucket, freed in place])."""
        buffer = self.buffers.get(bucket.index)
        if buffer is None:
            buffer = self.buffers[bucket.index] = torch.empty(bucket.numel, dtype=self.flat.dtype,
                                                              device=self.flat.device)
        else:
            buffer.untyped_storage().resize_(bucket.numel * buffer.element_size())
        return buffer

    def _gather_into(self, full: torch.Tensor, bucket: Bucket, comm: Communicator, purpose: str,
                     async_op: bool) -> Pending:
        """From the secondary shards inside the node group where they are kept, else from the primary shards
        over `comm` (keeping a secondary part, with hpZ). See [Note: hpZ's secondary copy]."""
        if bucket.index in self.secondary:
            return self.node.all_gather(full, self.secondary[bucket.index], async_op=async_op,
                                        purpose=f"{purpose} (hpZ secondary)")
        if self.node is not None and bucket.owner is None:
            self.secondary[bucket.index] = full.chunk(self.node.world_size)[self.node.rank]  # a view until done
            self.capturing.add(bucket.index)
        with self.home.issuing():  # See [Note: a parameter shard fetched ahead] in zerokit/tiers/copies.py
            source = self.home.fetch(self.shard(bucket), own_part(full, bucket, self.rank))
            pending = gather_bucket(comm, bucket, full, source, async_op=async_op, purpose=purpose)
        if not async_op:
            self._captured(bucket)
        return pending

    def _captured(self, bucket: Bucket) -> None:
        """The primary gather is done: the secondary part becomes a copy of its own."""
        if bucket.index in self.capturing:
            self.capturing.discard(bucket.index)
            self.secondary[bucket.index] = self.secondary[bucket.index].clone()

    def drop_secondary(self) -> None:
        """The shards changed (or will): the next gather of each bucket reads the primary shards again."""
        for index in list(self.capturing):
            self.wait(self.layout.buckets[index])
        self.secondary.clear()

    def wait(self, bucket: Bucket) -> None:
        if bucket.index in self.in_flight:
            wait(self.in_flight.pop(bucket.index))
        self._captured(bucket)

    def has(self, bucket: Bucket) -> bool:
        """Gathered, or being gathered."""
        return bucket.index in self.gathered

    def ready(self, bucket: Bucket) -> bool:
        return bucket.index in self.gathered and bucket.index not in self.in_flight

    def point(self, bucket: Bucket) -> None:
        self.flat.point(bucket, self.buffers[bucket.index])

    def free(self, bucket: Bucket) -> int:
        """Free the gathered bucket's memory (once its gather is done); returns the elements freed. The parameters
        still view it, empty, until `release`. See [Note: one buffer per bucket, freed in place]."""
        self.wait(bucket)
        if bucket.index not in self.gathered:
            return 0
        self.gathered.discard(bucket.index)
        self.buffers[bucket.index].untyped_storage().resize_(0)
        return bucket.numel

    def release(self, bucket: Bucket) -> None:
        self.flat.release(bucket, self.placeholder)

    def regather(self, bucket: Bucket, comm: Communicator, purpose: str = "") -> None:
        """Refresh a gathered bucket from the shards (after the shards changed), in place."""
        if bucket.index in self.gathered:
            self.wait(bucket)
            wait(self._gather_into(self.buffers[bucket.index], bucket, comm, purpose, async_op=False))

    def write_back(self, bucket: Bucket) -> torch.Tensor | None:
        """Keep in-place edits of a gathered bucket: this rank's part goes back to its shard, and is
        returned (None when the bucket is not gathered)."""
        if not self.ready(bucket):
            return None
        if self.shards_are_masters:  # only what was edited: See [Note: the shard is the fp32 master]
            edited = own_part(self.buffers[bucket.index], bucket, self.rank)
            copy_edits(self.shard(bucket), edited)
            return edited
        return self.keep_shard(bucket, self.buffers[bucket.index])

    def tensors(self) -> list[torch.Tensor]:
        """What this holds in memory: the shards, the gathered buckets, hpZ's secondary parts."""
        return [self.shards, *self._gathered_buffers(), *self._secondary_copies()]

    def _gathered_buffers(self) -> list[torch.Tensor]:
        return [self.buffers[index] for index in self.gathered]

    def _secondary_copies(self) -> list[torch.Tensor]:
        """The secondary parts held apart (one still being gathered is a view of its gathered bucket)."""
        return [part for index, part in self.secondary.items() if index not in self.capturing]

    def held_by_tier(self) -> dict[str, int]:
        """Bytes by tier: the shards where their home keeps them (unless they are the masters, which the masters
        count), the gathered buckets and hpZ's secondary parts on the device."""
        held = {"device": tensor_bytes(self._gathered_buffers()) + tensor_bytes(self._secondary_copies())}
        for tier, count in ({} if self.shards_are_masters else self.home.held(self.shards)).items():
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
