"""The process groups a stage communicates over, owned by the stage (not chosen by the engine).

[Note: hybrid sharding]
`zero_optimization.mics_shard_size: s` (DeepSpeed's MiCS, FSDP's HSDP) splits the N ranks into N/s shard groups
of s consecutive ranks (0..s-1, s..2s-1, ...): parameters, gradients and optimizer state are sharded inside each
shard group exactly as a flat stage shards them over N ranks, and every shard group holds the same states (the
replicas). Rank r holds shard r % s; the replica group of a shard is the ranks holding it (r % s equal), one per
shard group. With s the ranks per node, all of a step's all-gathers and reduce-scatters stay inside a node:
  - backward: each bucket is reduced inside the shard group (averaged over its s ranks), every micro-step or
    at the boundary, as the flat stage does;
  - at the accumulation boundary, after backward's last reduction: each reduced shard is all-reduced (averaged)
    across the replica group, once per optimizer step: the only traffic that crosses nodes (FSDP2's HSDP
    crosses on every micro-step by default). It runs after the whole backward, not overlapped with it: a rank
    blocked in a replica collective while its partner still waits on a shard-group gather could otherwise
    close a cycle of waits between the two kinds of group;
  - the step: the global norm sums squares over the shard group only (the replicas hold equal shards), while
    which parameters got a gradient is summed over every rank (a second, replica, all-reduce of those flags);
  - every replica steps the same masters with the same gradients, and all-gathers them inside its shard group.
Every rank makes every group, in the same order (shard groups, then replica groups): torch's new_group is a
collective over the whole job. Checkpoints are written by replica 0 alone and read per parameter, so a hybrid
checkpoint resumes flat and a flat one hybrid (See zerokit/stages/view.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerokit.comm.collectives import Communicator
from zerokit.config.settings import EngineSettings, consecutive_groups, strided_groups


@dataclass(frozen=True)
class ProcessGroups:
    shard: Communicator
    """The ranks that split the model states between them: gradient reductions, parameter all-gathers
    at stages 1-2, the global gradient norm. Every rank, unless MiCS splits them (See [Note: hybrid sharding])."""
    gather: Communicator
    """Stage 3's parameter gathers (from forward and backward hooks): a twin of `shard`, so that they
    cannot pair with a gradient reduction issued in another order on another rank (See Communicator.twin).
    The same Communicator as `shard` at stages 0-2."""
    replica: Communicator | None = None
    """The ranks that hold the same shard, one per shard group: the boundary's gradient all-reduce. None when
    one group shards over every rank."""
    replica_index: int = 0
    """Which copy of the states this rank holds (its shard group's index); replica 0 writes checkpoints."""
    world: Communicator | None = None
    """With MiCS, the engine's group over every rank (closed with these); None: it is `shard`."""
    node: Communicator | None = None
    """Stage 3 with hpZ: the k consecutive ranks that split the secondary copy of the parameter shards, which every
    gather after a step's first reads (See [Note: hpZ's secondary copy] in flat/sharded.py); None without hpZ."""

    def close(self) -> None:
        """Destroy the groups (See Communicator.close)."""
        self.gather.close()
        self.shard.close()
        for extra in (self.replica, self.world, self.node):
            if extra is not None:
                extra.close()

    @classmethod
    def for_stage(cls, comm: Communicator, settings: EngineSettings) -> "ProcessGroups":
        """`comm` is over every rank. See [Note: hybrid sharding]."""
        comm.stats.ranks_per_node = settings.ranks_per_node  # See [Note: bytes that cross nodes] in collectives.py
        size, twin = settings.shard_size, settings.stage == 3
        if settings.replicas == 1 or size == comm.world_size:
            k = settings.secondary_size
            node = comm.split(consecutive_groups(comm.world_size, k), "hpz_gather") if k > 1 else None
            return cls(shard=comm, gather=comm.twin() if twin else comm, node=node)
        shard_groups = consecutive_groups(comm.world_size, size)
        shard = comm.split(shard_groups, "mics_shard")
        gather = comm.split(shard_groups, "mics_gather", twin_of=shard) if twin else shard  # See Communicator.twin
        replica = comm.split(strided_groups(comm.world_size, size), "mics_replica")
        return cls(shard=shard, gather=gather, replica=replica, replica_index=comm.rank // size, world=comm)
