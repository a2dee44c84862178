"""Offload tiers: where the optimizer's masters and stage 3's parameter shards live when the device cannot
hold them (ZeRO-Offload, ZeRO-Infinity). A stage asks placement.py for homes; it never tests "if offload"."""

from zerokit.offload.params import DeviceShards, HostShards
from zerokit.offload.placement import master_homes, shard_home

__all__ = ["DeviceShards", "HostShards", "master_homes", "shard_home"]
