"""What the engine will do, decided once: the choices a config and the back-end make together (whether a
bucket is reduce-scattered or all-reduced, whether gradients leave the rank every micro-step, how many
elements a gradient bucket and an optimizer piece hold). Pure Python, no torch: the stages read these
decisions, and the planner predicts from the very same functions, so the two cannot drift apart.

[Note: one place for each engine decision]
Each decision here was once worked out again wherever it was needed (the stages, the engine's blocks, the
planner's engine model, memory and communication models), and the copies had begun to differ. A decision
that needs a value only known on a rank (where one master lives, for the optimizer piece size) is a
function of that value here, called by the engine with it and by the planner with its prediction of it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from fractions import Fraction

from zerokit.config.defaults import CPU_OPTIMIZER_PIECE_NUMEL

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each floating dtype the engine computes or communicates in, by its config name."""

ONE_PIECE_PER_PARAMETER = sys.maxsize


def reduces_by_scatter(backend: str, forced: bool | None) -> bool:
    """Whether stages 1-3 reduce-scatter a gradient bucket (True) or all-reduce it in place and keep this rank's
    shard: `zero_optimization.reduce_scatter` where set, else all but gloo (See [Note: reducing a bucket to a
    shard] in stages/base.py). Stage 0, which keeps whole gradients, all-reduces either way."""
    return forced if forced is not None else backend != "gloo"


def reduces_every_micro_step(stage: int, reduce_every_micro_step: bool) -> bool:
    """Stage 3, and stage 2 unless told otherwise, reduce each micro-step's gradients and accumulate the reduced
    shards; stages 0-1 (and stage 2 with reduce_every_micro_step=False) accumulate full gradients locally."""
    return stage == 3 or (stage == 2 and reduce_every_micro_step)


def shard_group_size(mics_shard_size: int | None, world_size: int, stage: int, ranks_per_node: int) -> int:
    """How many consecutive ranks split the model states between them (See [Note: hybrid sharding] in
    comm/groups.py): `zero_optimization.mics_shard_size` where it is a positive divisor of the world size; every
    rank where it is -1 or absent (DeepSpeed's default: MiCS off). Stage 0 shards nothing (ZeroConfig refuses the
    key there)."""
    if mics_shard_size is None or mics_shard_size == -1 or stage == 0:
        return world_size
    if mics_shard_size < 1 or world_size % mics_shard_size:
        raise ValueError(f"zero_optimization.mics_shard_size={mics_shard_size} does not divide the world size "
                         f"{world_size}; use a divisor of it (the ranks per node, {ranks_per_node}, shards inside "
                         "each node) or -1 for one group over every rank")
    return mics_shard_size


def secondary_group_size(hpz_partition_size: int | None, world_size: int, stage: int, shard_size: int,
                         ranks_per_node: int) -> int:
    """hpZ's k: the consecutive ranks that split stage 3's secondary copy of the parameters (See [Note: hpZ's
    secondary copy] in flat/sharded.py); 1 (absent, DeepSpeed's default) or the world size: none."""
    k = hpz_partition_size or 1
    if k == 1 or k == world_size:
        return 1
    if stage != 3 or shard_size != world_size:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size={k} needs stage 3 without mics_shard_size (hpZ "
                         f"keeps a second copy of stage 3's parameter shards); stage={stage}, mics_shard_size="
                         f"{shard_size if shard_size != world_size else -1}")
    if k < 1 or world_size % k:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size={k} does not divide the world size {world_size}; "
                         f"use a divisor of it (the ranks per node, {ranks_per_node}, keeps later gathers inside each "
                         "node) or 1 for none")
    return k


def bucket_numel(bucket_bytes: int, element_bytes: int) -> int:
    """Elements of a gradient bucket of `bucket_bytes` in a reduce dtype of `element_bytes` (at least one)."""
    return max(1, bucket_bytes // element_bytes)


def optimizer_piece_numel(sub_group_size: int | None, master_on_host: bool, fused: bool = False) -> int:
    """The most elements an optimizer piece holds (See [Note: optimizer pieces] in masters/shards.py):
    sub_group_size where given, except 0, which is one piece per parameter (DeepSpeed's 0 makes every
    parameter its own sub-group); else cache-sized pieces for a master in host memory stepped by a for-loop
    optimizer, whole parameter parts on a device or under a fused kernel."""
    if sub_group_size == 0:
        return ONE_PIECE_PER_PARAMETER
    if sub_group_size:
        return sub_group_size
    return CPU_OPTIMIZER_PIECE_NUMEL if master_on_host and not fused else ONE_PIECE_PER_PARAMETER


def ring_share(kind: str, n: int) -> Fraction:
    """The share of a collective's logical bytes that one rank of a ring of n sends, as the engine counts it (See
    [Note: bytes that cross nodes] in comm/collectives.py): all-reduce 2(n-1)/n; all-gather, reduce-scatter,
    broadcast and reduce (n-1)/n."""
    return Fraction(2 * (n - 1), n) if kind == "all_reduce" else Fraction(n - 1, n)


def consecutive_groups(world_size: int, size: int) -> list[list[int]]:
    """The ranks cut into groups of `size` consecutive ranks (MiCS's shard groups, hpZ's node groups)."""
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


def strided_groups(world_size: int, size: int) -> list[list[int]]:
    """The ranks with the same index in each group of `size` consecutive ranks (MiCS's replica groups)."""
    return [list(range(index, world_size, size)) for index in range(size)]


def ring_crosses_nodes(ranks: list[int], rank: int, ranks_per_node: int) -> bool:
    """Whether `rank`'s ring traffic on a group of global `ranks` goes to another node: the next rank of the ring
    (ascending global ranks, the last to the first) is on another node (See [Note: bytes that cross nodes] in
    comm/collectives.py)."""
    ring = sorted(ranks)
    following = ring[(ring.index(rank) + 1) % len(ring)]
    return rank // ranks_per_node != following // ranks_per_node


@dataclass(frozen=True)
class EngineSettings:
    """The decisions of one engine on one back-end (See [Note: one place for each engine decision])."""

    stage: int
    world_size: int
    reduce_scatter: bool
    """Stages 1-3: gradient buckets are reduce-scattered (else all-reduced in place, the shard kept)."""
    reduces_every_micro_step: bool
    """Gradients leave the rank on every micro-step (stage 3; stage 2 by default)."""
    bucket_numel: int
    """Elements per gradient bucket at stages 0-2 (stage 3: one bucket per unit and param group)."""
    shards_optimizer: bool
    """Every rank updates a shard (stages 1-3); at stage 0 every rank updates everything."""
    shard_size: int = 0
    """The consecutive ranks that split the model states (MiCS's s); the world size unless mics_shard_size says
    otherwise (0 here: the world size, for settings made field by field)."""
    ranks_per_node: int = 0
    """Ranks on each node (torchrun's LOCAL_WORLD_SIZE, or the config's); 0: all on one node."""
    secondary_size: int = 1
    """hpZ's k at stage 3: the consecutive ranks a secondary copy of the parameter shards is split over; 1: none."""

    def __post_init__(self) -> None:
        if not self.shard_size:
            object.__setattr__(self, "shard_size", self.world_size)
        if not self.ranks_per_node:
            object.__setattr__(self, "ranks_per_node", self.world_size)

    @classmethod
    def resolve(cls, *, stage: int, world_size: int, backend: str, reduce_scatter: bool | None,
                reduce_every_micro_step: bool, bucket_bytes: int, reduce_dtype: str, mics_shard_size: int | None = None,
                ranks_per_node: int | None = None, hpz_partition_size: int | None = None) -> "EngineSettings":
        per_node = ranks_per_node or world_size
        if world_size % per_node:
            raise ValueError(f"ranks_per_node={per_node} does not divide the world size {world_size}; give the ranks "
                             "on each node (nodes of equal size, numbered consecutively)")
        return cls(stage=stage, world_size=world_size,
                   reduce_scatter=reduces_by_scatter(backend, reduce_scatter),
                   reduces_every_micro_step=reduces_every_micro_step(stage, reduce_every_micro_step),
                   bucket_numel=bucket_numel(bucket_bytes, ELEMENT_BYTES[reduce_dtype]),
                   shards_optimizer=stage > 0,
                   shard_size=(shard := shard_group_size(mics_shard_size, world_size, stage, per_node)),
                   ranks_per_node=per_node,
                   secondary_size=secondary_group_size(hpz_partition_size, world_size, stage, shard, per_node))

    @property
    def layout_world_size(self) -> int:
        """The ranks a bucket is split over: the shard group from stage 1 up (every rank unless MiCS splits them);
        one at stage 0, which shards nothing."""
        return self.shard_size if self.shards_optimizer else 1

    @property
    def replicas(self) -> int:
        """How many copies of each shard the ranks hold (MiCS: world size / s; 1 when one group shards all)."""
        return self.world_size // self.shard_size

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.ranks_per_node)


__all__ = ["ELEMENT_BYTES", "EngineSettings", "bucket_numel", "optimizer_piece_numel", "reduces_by_scatter",
           "reduces_every_micro_step", "secondary_group_size", "shard_group_size", "consecutive_groups", "strided_groups",
           "ring_crosses_nodes", "ring_share"]
