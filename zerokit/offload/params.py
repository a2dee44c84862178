"""Where stage 3's parameter shards live between gathers (offload_param): the device, or host memory.

A gather starts from this rank's shard on the device; a shard kept elsewhere is first copied into its slot
of the buffer being gathered (asynchronously from pinned memory on CUDA), so the all-gather itself never
changes. Writing a shard (construction, publishing updated masters, kept edits) goes the other way. Every
copy between tiers is counted in comm_stats() (host_to_device, device_to_host). As for masters, the host
tier keeps its own copy and moves it even when the "device" is the CPU (See [Note: the host tier on a
machine without a GPU] in zerokit/masters/homes.py).
"""

from __future__ import annotations

import torch

from zerokit.comm import CommStats, Transfer


class DeviceShards:
    """The default: shards on the device the model computes on."""

    tier = "device"
    offloaded = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """What to gather from: the shard itself."""
        return shard

    def store(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        shard.copy_(values)


class HostShards:
    """offload_param.device=cpu: shards in (pinned) host memory."""

    tier = "host"
    offloaded = True

    def __init__(self, device: torch.device, pin_memory: bool, stats: CommStats) -> None:
        self.device, self.stats = device, stats
        self.pin = pin_memory and torch.cuda.is_available()  # page-locking needs the CUDA driver

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=self.pin)

    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Copy the shard into `slot` (its place in the device buffer being gathered) and gather from there."""
        slot.copy_(shard, non_blocking=slot.is_cuda)
        self.stats.record(Transfer.HOST_TO_DEVICE, shard)
        return slot

    def store(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        """`values` come from the device side (a gathered bucket, the values a model was built with)."""
        shard.copy_(values)
        self.stats.record(Transfer.DEVICE_TO_HOST, shard)
