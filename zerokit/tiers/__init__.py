"""The storage tiers: where an fp32 master (homes.py, nvme_masters.py) and a stage-3 parameter shard (shards.py,
nvme_shards.py) live, on the device, in host memory or in swap files on NVMe (swap.py), with the pre-flight
checks of host memory and the NVMe path (preflight.py), and the placement that picks a home for each from the
config (placement.py). A stage asks placement.py for homes and talks to them through `Home` and `ShardIO`; it
never tests which tier it holds. Names are imported on first use: read_order.py is pure Python, which the
planner reads without torch."""

from zerokit._support.lazy import lazy_names

_LAZY = {
    **dict.fromkeys(["DeviceHome", "HostHome", "Home", "ShardIO"], "zerokit.tiers.homes"),
    **dict.fromkeys(["master_homes", "shard_home"], "zerokit.tiers.placement"),
    **dict.fromkeys(["DeviceShards", "HostShards"], "zerokit.tiers.shards"),
}
__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY, globals())
