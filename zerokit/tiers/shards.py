"""Where compute shards live between uses: the device, host memory (offload_param.device=cpu), or NVMe
files (offload_param.device=nvme, ZeRO-Infinity). Stages 0-2 keep theirs in the flat buffer on the device;
stage 3's parameter shards can live on any tier.

A shard home is asked for three things: `fetch` a shard onto the device for a gather (a shard kept
elsewhere is first copied into its slot of the buffer being gathered, so the all-gather itself never
changes), `write` values into a shard (construction, published masters, kept edits), and `read` a shard's
values into a tier's memory (masters keeping edits). Every byte that crosses between tiers is counted in
comm_stats() (host_to_device, device_to_host, nvme_read, nvme_write). As for masters, the host tier keeps
its own copy and moves it even when the "device" is the CPU (See [Note: the host tier on a machine without
a GPU] in zerokit/tiers/homes.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

from zerokit.comm import CommStats, Transfer
from zerokit.flat.layout import RankShards
from zerokit.tiers.copies import on_copy_stream
from zerokit.tiers.pinned import host_buffer
from zerokit.tiers.preflight import check_host_memory


class _MemoryShards:
    """A tier that keeps shards in memory, the device's or the host's: values written from the other one, and
    values read for it, are copies counted in comm_stats(). `tier` and `other` are "device" and "host" one way or
    the other round (a master's home names where its values come from or go to)."""

    tier: str
    into: Transfer  # what a write from the other tier counts
    out_of: Transfer  # what a read for the other tier counts
    swap = None

    def __init__(self, device: torch.device, stats: CommStats) -> None:
        self.device, self.stats = device, stats

    def write(self, shard: torch.Tensor, values: torch.Tensor, source: str) -> None:
        shard.copy_(values, non_blocking=values.is_pinned())
        if source != self.tier:
            self.stats.record(self.into, shard)

    def held(self, shards: torch.Tensor) -> dict[str, int]:
        return {self.tier: shards.numel() * shards.element_size()}

    def issuing(self) -> ContextManager[None]:
        """Where a prefetch's fetch and gather are issued: the default stream (host shards: See HostShards)."""
        return nullcontext()

    def read(self, shard: torch.Tensor, target: str) -> torch.Tensor:
        if target == self.tier:
            return shard
        self.stats.record(self.out_of, shard)
        return shard.to("cpu" if self.tier == "device" else self.device)


class DeviceShards(_MemoryShards):
    """The default: shards on the device the model computes on."""

    tier, into, out_of = "device", Transfer.HOST_TO_DEVICE, Transfer.DEVICE_TO_HOST

    def allocate(self, local: RankShards, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(local.numel, dtype=dtype, device=self.device)

    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """What to gather from: the shard itself, or, where the shard is the fp32 master, its cast into `slot`
        (See [Note: the shard is the fp32 master] in zerokit/flat/sharded.py)."""
        if shard.dtype == slot.dtype:
            return shard
        slot.copy_(shard)
        return slot


class HostShards(_MemoryShards):
    """offload_param.device=cpu: shards in (pinned) host memory."""

    tier, into, out_of = "host", Transfer.DEVICE_TO_HOST, Transfer.HOST_TO_DEVICE

    def __init__(self, device: torch.device, pin_memory: bool, stats: CommStats, ranks_per_node: int) -> None:
        super().__init__(device, stats)
        self.pin = pin_memory and torch.cuda.is_available()  # page-locking needs the CUDA driver
        self.ranks_per_node = ranks_per_node  # whose shards share this node's host memory

    def allocate(self, local: RankShards, dtype: torch.dtype) -> torch.Tensor:
        element = torch.empty((), dtype=dtype).element_size()
        check_host_memory("zero_optimization.offload_param", local.numel * element, self.ranks_per_node)
        return host_buffer(local.numel, dtype=dtype, pin=self.pin, zeroed=True)  # See zerokit/tiers/pinned.py

    def issuing(self) -> ContextManager[None]:
        """The copy stream: See [Note: a parameter shard fetched ahead] in zerokit/tiers/copies.py."""
        return on_copy_stream(self.device)

    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Copy the shard into `slot` (its place in the device buffer being gathered) and gather from there."""
        slot.copy_(shard, non_blocking=slot.is_cuda)
        if shard.numel():
            self.stats.record(Transfer.HOST_TO_DEVICE, shard)
        return slot
