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

import torch

from zerokit.comm import CommStats, Transfer
from zerokit.flat.layout import RankShards
from zerokit.tiers.preflight import check_host_memory


class DeviceShards:
    """The default: shards on the device the model computes on."""

    tier, swap = "device", None

    def __init__(self, device: torch.device, stats: CommStats) -> None:
        self.device, self.stats = device, stats

    def allocate(self, local: RankShards, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(local.numel, dtype=dtype, device=self.device)

    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """What to gather from: the shard itself."""
        return shard

    def write(self, shard: torch.Tensor, values: torch.Tensor, source: str) -> None:
        shard.copy_(values, non_blocking=values.is_pinned())
        if source == "host":
            self.stats.record(Transfer.HOST_TO_DEVICE, shard)

    def held(self, shards: torch.Tensor) -> dict[str, int]:
        return {self.tier: shards.numel() * shards.element_size()}

    def read(self, shard: torch.Tensor, target: str) -> torch.Tensor:
        if target == "device":
            return shard
        self.stats.record(Transfer.DEVICE_TO_HOST, shard)
        return shard.to("cpu")


class HostShards:
    """offload_param.device=cpu: shards in (pinned) host memory."""

    tier, swap = "host", None

    def __init__(self, device: torch.device, pin_memory: bool, stats: CommStats) -> None:
        self.device, self.stats = device, stats
        self.pin = pin_memory and torch.cuda.is_available()  # page-locking needs the CUDA driver

    def allocate(self, local: RankShards, dtype: torch.dtype) -> torch.Tensor:
        element = torch.empty((), dtype=dtype).element_size()
        check_host_memory("zero_optimization.offload_param", local.numel * element)
        return torch.zeros(local.numel, dtype=dtype, pin_memory=self.pin)

    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Copy the shard into `slot` (its place in the device buffer being gathered) and gather from there."""
        slot.copy_(shard, non_blocking=slot.is_cuda)
        if shard.numel():
            self.stats.record(Transfer.HOST_TO_DEVICE, shard)
        return slot

    def write(self, shard: torch.Tensor, values: torch.Tensor, source: str) -> None:
        shard.copy_(values)
        if source == "device":
            self.stats.record(Transfer.DEVICE_TO_HOST, shard)

    def held(self, shards: torch.Tensor) -> dict[str, int]:
        return {self.tier: shards.numel() * shards.element_size()}

    def read(self, shard: torch.Tensor, target: str) -> torch.Tensor:
        if target == "host":
            return shard
        self.stats.record(Transfer.HOST_TO_DEVICE, shard)
        return shard.to(self.device)
