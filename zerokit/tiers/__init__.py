"""The storage tiers: where an fp32 master (homes.py, nvme_masters.py) and a stage-3 parameter shard (shards.py,
nvme_shards.py) live, on the device, in host memory or in swap files on NVMe (swap.py), with the pre-flight
checks of host memory and the NVMe path (preflight.py), and the placement that picks a home for each from the
config (placement.py). A stage asks placement.py for homes and talks to them through `Home` and `ShardIO`; it
never tests which tier it holds."""

from zerokit.tiers.homes import DeviceHome, HostHome, Home, ShardIO, copy_edits
from zerokit.tiers.placement import master_homes, shard_home
from zerokit.tiers.shards import DeviceShards, HostShards

__all__ = ["DeviceHome", "DeviceShards", "Home", "HostHome", "HostShards", "ShardIO", "copy_edits", "master_homes",
           "shard_home"]
