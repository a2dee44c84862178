"""Which tier each master lives on, from the config's offload_optimizer block.

[Note: Twin-Flow]
`offload_optimizer.ratio` (DeepSpeed's Twin-Flow) is the share of the optimizer stepped on the CPU. The
masters are given to the host in layout order until they hold that share of this rank's elements; the
rest stay on the device. Both kinds are pieces of the same optimizer, so one optimizer.step() updates
them all (an LR schedule sees one optimizer): torch steps the device's pieces with asynchronous kernels,
so on a GPU they run while the CPU works through the host's. The split is by whole masters (buckets),
so the share is met to within one bucket.
"""

from __future__ import annotations

import torch

from zerokit._support.log import logger
from zerokit.comm import CommStats
from zerokit.config.defaults import NVME_SUB_GROUP_NUMEL
from zerokit.config.settings import OffloadSettings
from zerokit.tiers.homes import DeviceHome, Home, HostHome, ShardIO
from zerokit.tiers.nvme_masters import NvmeHome
from zerokit.tiers.nvme_shards import NvmeShards
from zerokit.tiers.shards import DeviceShards, HostShards
from zerokit.tiers.preflight import aligned, check_host_memory, check_nvme, state_bytes_per_element
from zerokit.tiers.swap import BufferPool, SwapDirectory


def master_homes(compute: list[torch.Tensor], part: OffloadSettings, stats: CommStats, device: torch.device, rank: int,
                 io: ShardIO, optimizer_names: list[str]) -> list[Home]:
    """A home for each master, given the compute shard it publishes to, the device the model runs on, the
    compute shards' home (the device's flat buffer; stage 3's parameter tier), and the optimizers' class
    names (for the pre-flight check of what their state needs)."""
    offload, key = part.optimizer, "zero_optimization.offload_optimizer"
    per_element = 8 + state_bytes_per_element(optimizer_names)  # fp32 master and gradient, and the state
    if offload.device == "nvme":
        # 0 makes every piece (whole parameters then) a sub-group, as DeepSpeed's 0 does
        sub_group = part.sub_group_size if part.sub_group_size is not None else NVME_SUB_GROUP_NUMEL
        largest = max((shard.numel() for shard in compute), default=0)
        largest = min(sub_group, largest) if sub_group else largest
        pool = BufferPool(offload.buffer_count, offload.pin_memory)
        check_host_memory(key, pool.count * largest * per_element, part.ranks_per_node)
        speed = check_nvme(key, offload.nvme_path, aligned(sum(shard.numel() for shard in compute) * per_element),
                           part.ranks_per_node)
        swap = SwapDirectory(offload.nvme_path, rank, "optimizer")
        _log_swap(key, swap, speed)
        if rank == 0:
            logger.info("%s: host memory holds %d swap buffers of a sub-group of up to %s elements each (about "
                        "%.1f MiB in all; zero_optimization.sub_group_size sets it)", key, pool.count,
                        f"{largest:,}", pool.count * largest * per_element / 2**20)
        return [NvmeHome(shard, f"master{index}", swap, pool, stats, io, sub_group)
                for index, shard in enumerate(compute)]
    on_host = _host_share(compute, offload.ratio) if offload.enabled else [False] * len(compute)
    check_host_memory(key, sum(shard.numel() for shard, host in zip(compute, on_host) if host) * per_element,
                      part.ranks_per_node)
    return [HostHome(shard, offload.pin_memory, stats, io) if host else
            DeviceHome(shard, device, io, part.param_dtype) for shard, host in zip(compute, on_host)]


def _log_swap(key: str, swap: SwapDirectory, speed: float) -> None:
    if swap.rank == 0:
        logger.info("%s: swap files in %s (direct I/O: %s); a 4 MiB write and read went at %.2f GB/s", key, swap.path,
                    "yes" if swap.direct_io else "no, the file system refused it", speed)


def shard_home(part: OffloadSettings, stats: CommStats, device: torch.device, rank: int) -> ShardIO:
    """Where stage 3's parameter shards live between gathers (offload_param)."""
    offload = part.param
    if offload.device == "nvme":
        # what the shards need is checked when they are allocated
        speed = check_nvme("zero_optimization.offload_param", offload.nvme_path, 0, part.ranks_per_node)
        swap = SwapDirectory(offload.nvme_path, rank, "params")
        _log_swap("zero_optimization.offload_param", swap, speed)
        return NvmeShards(device, offload, stats, swap, part.ranks_per_node)
    if offload.device == "cpu":
        return HostShards(device, offload.pin_memory, stats, part.ranks_per_node)
    return DeviceShards(device, stats)


def _host_share(compute: list[torch.Tensor], ratio: float) -> list[bool]:
    """See [Note: Twin-Flow]."""
    total = sum(shard.numel() for shard in compute)
    placed, on_host = 0, []
    for shard in compute:
        host = ratio >= 1.0 or placed < ratio * total
        on_host.append(host)
        placed += shard.numel() if host else 0
    return on_host
