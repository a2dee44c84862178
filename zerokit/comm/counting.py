"""What every collective and tier transfer is counted as: calls, elements and bytes by kind, per engine (each
Communicator of an engine shares its CommStats), and, across nodes, by group and in bytes that cross nodes.

The counting convention (the logical tensor's size, and each ring's share) and [Note: bytes that cross nodes] are
written in collectives.py, beside the collectives they describe, where the planner reads them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist

from zerokit.config.settings import ring_crosses_nodes, ring_share


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"


class Transfer(str, Enum):
    """Bytes an offload tier moves between memories (counted beside the collectives, sent by no one)."""

    HOST_TO_DEVICE = "host_to_device"
    DEVICE_TO_HOST = "device_to_host"
    NVME_READ = "nvme_read"
    NVME_WRITE = "nvme_write"


RING_FACTOR = {kind: (lambda n, name=kind.value: float(ring_share(name, n))) for kind in Collective}
"""Ring traffic per rank as a multiple of the logical bytes, for N ranks (config/settings.py's ring_share, which the
planner reads too)."""


@dataclass
class CollectiveCount:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    world_size: int
    counts: dict[Collective | Transfer, CollectiveCount] = field(
        default_factory=lambda: {kind: CollectiveCount() for kind in (*Collective, *Transfer)})
    ranks_per_node: int | None = None
    """Set once the stage knows the nodes (See [Note: bytes that cross nodes]); None: not split by group."""
    by_group: dict[str, dict[Collective, CollectiveCount]] = field(default_factory=dict)
    cross_node_bytes: float = 0.0

    def record(self, kind: Collective | Transfer, tensor: torch.Tensor, group: str = "",
               ring_share: float = 0.0) -> None:
        """`ring_share`: the share of the bytes this rank sends to another node (See [Note: bytes that cross
        nodes]); `group`: the Communicator's name, for the split by group."""
        count = self.counts[kind]
        _add(count, tensor)
        if self.spans_nodes and kind in RING_FACTOR and group:
            self.add_group(group)
            _add(self.by_group[group][kind], tensor)
            self.cross_node_bytes += ring_share * tensor.numel() * tensor.element_size()

    def add_group(self, group: str) -> None:
        """Count `group`'s collectives apart from the start (so that comm_stats() keeps the same keys throughout)."""
        self.by_group.setdefault(group, {kind: CollectiveCount() for kind in Collective})

    @property
    def spans_nodes(self) -> bool:
        return self.ranks_per_node is not None and self.ranks_per_node < self.world_size

    def wire_bytes(self) -> float:
        """Bytes this rank sends on a ring over every rank, summed over all collectives."""
        return sum(RING_FACTOR[kind](self.world_size) * count.bytes for kind, count in self.counts.items()
                   if kind in RING_FACTOR)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Per kind, every group together; across nodes, also "<group>.<kind>" and "cross_node"."""
        stats = {kind.value: vars(count).copy() for kind, count in self.counts.items()}
        if self.spans_nodes:
            for group, counts in self.by_group.items():
                stats.update({f"{group}.{kind.value}": vars(count).copy() for kind, count in counts.items()})
            stats["cross_node"] = {"bytes": round(self.cross_node_bytes)}
        return stats


def _add(count: CollectiveCount, tensor: torch.Tensor) -> None:
    count.calls += 1
    count.elements += tensor.numel()
    count.bytes += tensor.numel() * tensor.element_size()


class GroupCount:
    """One process group's counting into the CommStats it shares: under the group's name, with the share of its ring
    traffic that crosses nodes (See [Note: bytes that cross nodes]). It is handed the group at each count rather than
    keeping it: a reference held here would outlive Communicator.close() and keep gloo's threads for the group alive
    until the interpreter finalizes (See [Note: leaving at exit] in zerokit/comm/process.py)."""

    def __init__(self, stats: CommStats, name: str, rank: int, world_size: int) -> None:
        self.stats, self.name, self.rank, self.world_size = stats, name, rank, world_size
        self._crosses: bool | None = None  # whether the next rank of this group's ring is on another node
        stats.add_group(name)

    def record(self, kind: Collective, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        share = RING_FACTOR[kind](self.world_size) if self.stats.spans_nodes and self.crosses_nodes(group) else 0.0
        self.stats.record(kind, tensor, self.name, share)

    def crosses_nodes(self, group: dist.ProcessGroup | None) -> bool:
        """Whether this rank's ring traffic on `group` (this count's) goes to another node; decided on first use, once
        the stats know the nodes."""
        if self._crosses is None and self.stats.ranks_per_node is not None and group is not None:
            self._crosses = ring_crosses_nodes(dist.get_process_group_ranks(group),
                                               dist.get_global_rank(group, self.rank), self.stats.ranks_per_node)
        return bool(self._crosses)
