"""The engine as it is, from its exact parameter inventory: bucket layout, model states at the backward
peak and after the step, and every collective of a step, in the units of `engine.memory_stats()` and
`engine.comm_stats()`, to the byte. Pure Python (no torch).

[Note: the engine's bookkeeping, element by element]
The architecture-level model (memory.py, comms.py) prices Ψ. The engine holds padded buckets, so an
exact prediction needs what the engine builds its layout from: each parameter's size, optimizer param
group and stage-3 unit, in the model's registration order (`ParamInventory`, made from a real module by
zerokit.profiling.inventory). From it, as the engine does (zerokit/flat/layout.py, zerokit/stages/):
  - trainable parameters in reverse registration order (the order backward usually finishes them);
    stages 0-2 bucket them per param group, closing a bucket once it reaches reduce_bucket_bytes of the
    reduce dtype; stage 3 makes one bucket per (unit, param group). A bucket is padded to a multiple of
    the shard group's s ranks (N, unless MiCS splits them; stage 0: 1, it shards nothing) and rank r owns
    shard r % s of every bucket (See [Note: hybrid sharding] in zerokit/comm/groups.py).
  - parameters: the flat buffer in the compute dtype (stage 3: the shards, unless they are the fp32 masters (See
    `shards_are_masters`), plus the full buckets of the units that stay gathered, and with hpZ the secondary
    copy: See `secondary_numel`); frozen parameters
    whole in the compute dtype (stage 3: one padded buffer per unit, sharded).
  - gradients: stages 0-1 keep a full flat gradient buffer in the compute dtype; where the reduce dtype
    differs, each reduced bucket (stage 0) or shard (stage 1) is kept in the reduce dtype from backward
    until the step releases it. Stages 2-3 keep only the reduced shards, in the reduce dtype.
  - optimizer state: fp32 masters of the owned slices (not when training in fp32: the parameter is the
    master) plus the optimizer's state per piece: Adam's two moments and a 4-byte step count, stepped in
    CPU_OPTIMIZER_PIECE_NUMEL-element pieces on the CPU unless a fused kernel steps them (See [Note: optimizer
    pieces] in the engine).
  - collectives: each bucket's gradient reduction, an all-reduce on gloo unless reduce_scatter is forced
    (See [Note: reducing a bucket to a shard]), the all-gather of updated parameters (stages 1-2), the
    stage-3 gathers (a unit before its forward and again before its backward, the root once, a
    persistent unit only when published after the step), at stages 1-3 one float64 all-reduce of
    the sum of squares behind the global norm with one usage flag per trainable parameter behind it (at
    stage 0 the flags ride behind the last gradient bucket: See [Note: parameters no rank used]) and,
    with broadcast_buffers, one broadcast of the module's buffers per dtype and micro-step (See [Note:
    buffers kept in step] in zerokit/reliability/buffers.py). With MiCS, the reductions, gathers and norm go
    over the shard group and, at the boundary, each reduced shard and the usage flags are all-reduced across
    the replicas; with hpZ every gather of a bucket but the first of a step goes over the node group. Once
    the job spans nodes, each is also counted under its group and, per rank, in the bytes that cross nodes
    (See [Note: bytes that cross nodes] in zerokit/comm/collectives.py).
  - offload transfers: See [Note: offload traffic, copy by copy] in engine_offload.py.

[Note: split experts in the engine model]
With MoE experts split over `expert` ranks (EngineSetup.expert > 1) the engine runs two ZeRO stages (See [Note: ZeRO
over experts split across ranks] in zerokit/parallel/experts/share.py), and so does this model (`stage_parts`): the
inventory's entries marked `expert` (this rank's experts' parameters) make the experts' part, every other entry the
dense part, and each part is priced by the same functions with its own setup:
  dense    the setup as given, with the module's buffers and fixed bytes;
  experts  over their expert-data group of world / expert ranks as one shard group (MiCS is refused, hpZ's copy is the
           dense stage's alone), rank r at place r // expert of it (the groups are strided: See [Note: the expert
           dimension] in zerokit/parallel/mesh.py); at stage 3 each local expert is a unit (the entries' `unit`) and
           none stays gathered (persistence threshold 0, as ExpertShare.part sets it).
Model states are the parts' sums; so are the collectives, but for the norm: at stages 1-3 the experts' usage flags
are all-reduced over their expert-data group alone (float64) while their squares join the dense norm's all-reduce, and
at stage 0 their flags ride behind their last bucket and one float64 scalar, their squares, is all-reduced over
every rank. Across nodes the experts' collectives are counted by kind only: their split by group and the bytes that
cross nodes are not modelled yet.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import cached_property

from zerokit.config.defaults import DEFAULT_BUCKET_BYTES, STAGE3_PARAM_PERSISTENCE_THRESHOLD
from zerokit.flat.layout import build_layout, round_up
from zerokit.config.settings import (EngineChoices, EngineSettings, Facts, consecutive_groups, decide,
                                     optimizer_piece_numel, ring_crosses_nodes, ring_share, strided_groups)
from zerokit.planner.spec import BYTES_PER_ELEMENT, OFFLOAD_DEVICES, PRECISIONS, _choice, _positive_int

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
# Optimizer state per owned element besides the master, and whether it keeps a 4-byte step tensor per piece.
STATE_BYTES = {"adamw": (8, True), "adam": (8, True), "sgd-momentum": (4, False), "sgd": (0, False)}


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as the engine sees it."""

    name: str
    numel: int
    group: int
    """Index of its optimizer param group (-1 when frozen: in no group, or in one but not trainable)."""
    unit: int
    """Its stage-3 unit (0 = the root), after small parameters joined the root."""
    trainable: bool = True
    floating: bool = True
    """Frozen integer parameters stay whole and keep their dtype (their bytes are in `fixed_bytes`)."""
    expert: bool = False
    """One of this rank's MoE experts split over ranks: held by the experts' own stage, `unit` its unit there (See
    [Note: split experts in the engine model])."""


@dataclass(frozen=True)
class ParamInventory:
    """Every distinct parameter of a model, in registration order (`model.parameters()`)."""

    entries: tuple[ParamEntry, ...]
    fixed_bytes: int = 0
    """Bytes of non-floating frozen parameters, which no stage casts or shards."""
    source: str = ""
    buffers: tuple[tuple[int, int], ...] = ()
    """The module's buffers, one (elements, bytes per element) per flat tensor `broadcast_buffers` sends."""

    def __post_init__(self) -> None:
        if not any(e.trainable for e in self.entries):
            raise ValueError("the inventory has no trainable parameter; the engine needs at least one")

    @property
    def trainable_numel(self) -> int:
        return sum(e.numel for e in self.entries if e.trainable)

    @property
    def total_numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def trainable_count(self) -> int:
        """Trainable parameters: one usage flag each (See [Note: parameters no rank used])."""
        return len([e for e in self.entries if e.trainable])

    def as_dict(self) -> dict:
        return {"entries": [vars(e).copy() for e in self.entries], "fixed_bytes": self.fixed_bytes,
                "source": self.source, "buffers": [list(b) for b in self.buffers]}

    @staticmethod
    def from_dict(raw: dict) -> ParamInventory:
        return ParamInventory(tuple(ParamEntry(**e) for e in raw["entries"]), raw.get("fixed_bytes", 0),
                              raw.get("source", ""), tuple(tuple(b) for b in raw.get("buffers", ())))


@dataclass(frozen=True, kw_only=True)
class EngineSetup:
    """The settings of `zerokit.initialize` that decide what a rank holds and sends."""

    stage: int
    world: int
    precision: str = "fp32"
    reduce_dtype: str = "fp32"
    optimizer: str = "adamw"
    fused_optimizer: bool = False
    """The optimizer steps with a fused kernel (torch's fused=True, what a config's optimizer block builds): its
    host-memory masters are cut at parameter boundaries only (See [Note: optimizer pieces] in the engine)."""
    backend: str = "gloo"
    device: str = "cpu"
    reduce_scatter: bool | None = None
    """None: the engine's default, reduce-scatter on NCCL and all-reduce on gloo."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sub_group_size: int | None = None
    reduce_every_micro_step: bool = True
    grad_accum: int = 1
    persistence_threshold: int = STAGE3_PARAM_PERSISTENCE_THRESHOLD
    offload_optimizer: str = "none"
    """none | cpu | nvme: where the fp32 masters and their optimizer state live (stages 1-3)."""
    offload_param: str = "none"
    """none | cpu | nvme: where stage 3's parameter shards live between gathers."""
    max_in_cpu: int = 1_000_000_000
    """offload_param=nvme: shard elements kept in host memory (the engine's default, DeepSpeed's 1e9)."""
    buffer_size: int = 100_000_000
    """offload_param=nvme: elements per swap record of a shard outside the host cache (DeepSpeed's 1e8; 0: a
    shard is one record)."""
    broadcast_buffers: bool = True
    mics_shard_size: int | None = None
    """MiCS's s (stages 1-3): consecutive ranks that split the model states, replicated across the groups; None or
    -1: one group over every rank. See [Note: hybrid sharding] in zerokit/comm/groups.py."""
    ranks_per_node: int | None = None
    """Ranks on each node (None: every rank on one node); decides which ring traffic crosses nodes."""
    hpz_partition_size: int | None = None
    """hpZ's k (stage 3): consecutive ranks that split the secondary copy of the parameter shards; None or 1: none."""
    sequence: int = 1
    """Ranks each replica's sequences are split over (Ulysses): a rank's activations are 1 / sequence of its
    replica's; the model states shard over every rank alike (See [Note: the sequence dimension] in
    zerokit/parallel/mesh.py)."""
    expert: int = 1
    """Ranks each MoE layer's experts are split over (ep): this rank's experts shard over their expert-data group of
    world / expert ranks, the rest over every rank (See [Note: split experts in the engine model]); 1: none split."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        _positive_int("world", self.world)
        _positive_int("sequence", self.sequence)
        _positive_int("bucket bytes", self.bucket_bytes)
        _positive_int("grad accum", self.grad_accum)
        _choice("precision", self.precision, PRECISIONS)
        _choice("reduce dtype", self.reduce_dtype, PRECISIONS)
        _choice("optimizer", self.optimizer, tuple(STATE_BYTES))  # element-wise ones: every rank steps a flat shard
        _choice("backend", self.backend, BACKENDS)
        _choice("device", self.device, DEVICES)
        _choice("optimizer offload", self.offload_optimizer, OFFLOAD_DEVICES)
        _choice("parameter offload", self.offload_param, OFFLOAD_DEVICES)
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("optimizer offload needs stage 1, 2 or 3 (the engine refuses it at stage 0)")
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError("parameter offload needs stage 3, the only stage that shards parameters")
        if isinstance(self.max_in_cpu, bool) or not isinstance(self.max_in_cpu, int) or self.max_in_cpu < 0:
            raise ValueError(f"max_in_cpu={self.max_in_cpu!r} must be an integer >= 0")
        if isinstance(self.buffer_size, bool) or not isinstance(self.buffer_size, int) or self.buffer_size < 0:
            raise ValueError(f"buffer_size={self.buffer_size!r} must be an integer >= 0")
        self.settings  # the engine's own one-line errors for shard, hpZ and node sizes that do not divide the world
        self._check_experts()

    def _check_experts(self) -> None:
        """The expert degrees the engine trains (zerokit/parallel/experts/share.py refuses the rest in one line)."""
        _positive_int("expert", self.expert)
        if self.expert == 1:
            return
        if self.world % self.expert:
            raise ValueError(f"expert={self.expert} does not divide the {self.world} ranks; use a divisor of them")
        if self.sequence > 1 or self.settings.replicas > 1 or "nvme" in (self.offload_optimizer, self.offload_param):
            raise ValueError(f"expert={self.expert} beside a sequence degree, MiCS or NVMe offload: the engine refuses "
                             "split experts with them; accepted: an expert degree over flat data parallelism")

    @cached_property
    def settings(self) -> EngineSettings:
        """The engine's own decisions for this setup (zerokit/config/settings.py), not a copy of them."""
        choices = EngineChoices(stage=self.stage, reduce_scatter=self.reduce_scatter,
                                reduce_every_micro_step=self.reduce_every_micro_step, bucket_bytes=self.bucket_bytes,
                                reduce_dtype=self.reduce_dtype, mics_shard_size=self.mics_shard_size,
                                hpz_partition_size=self.hpz_partition_size, ranks_per_node=self.ranks_per_node)
        # the predicted facts; the nodes are stated as a config states them (the plan's config names them: emit.py)
        return decide(choices, Facts(world_size=self.world, backend=self.backend))

    @property
    def shards_are_masters(self) -> bool:
        """Stage 3 keeps its trainable shards in fp32, as the masters, under a 16-bit compute dtype with the shards
        and the optimizer on the device (zerokit/flat/sharded.py, [Note: the shard is the fp32 master])."""
        return (self.stage == 3 and self.precision != "fp32" and self.offload_optimizer == "none"
                and self.offload_param == "none")

    @property
    def shard_size(self) -> int:
        """The ranks one bucket is split over: MiCS's s, else every rank (stage 0: one, it shards nothing)."""
        return self.settings.layout_world_size

    @property
    def reduces_by_scatter(self) -> bool:
        return self.settings.reduce_scatter

    @property
    def piece_numel(self) -> int:
        # the piece size follows where the master lives (an offloaded one is in host memory) and how it is stepped
        # (a fused kernel's pieces are whole parameter parts, but on NVMe, whose records are runs of pieces)
        return optimizer_piece_numel(self.sub_group_size,
                                     master_on_host=self.device == "cpu" or self.offload_optimizer != "none",
                                     fused=self.fused_optimizer and self.offload_optimizer != "nvme")

    @property
    def reduce_every_step(self) -> bool:
        return self.settings.reduces_every_micro_step


@dataclass(frozen=True)
class BucketPlan:
    index: int
    group: int
    unit: int
    numel: int
    """Padded to a multiple of the world size (stage 0: unpadded)."""
    sizes: tuple[int, ...]
    """Its parameters' elements, in bucket order."""
    world: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world

    def slices(self, rank: int) -> list[int]:
        """Elements of each parameter part in `rank`'s shard (the optimizer steps each part apart)."""
        begin, end = rank * self.shard_numel, (rank + 1) * self.shard_numel
        parts, offset = [], 0
        for size in self.sizes:
            overlap = min(end, offset + size) - max(begin, offset)
            if overlap > 0:
                parts.append(overlap)
            offset += size
        return parts


@dataclass(frozen=True)
class StagePart:
    """One ZeRO stage of the engine: the model's, or its split experts' own (See [Note: split experts in the engine
    model])."""

    inventory: ParamInventory
    setup: EngineSetup
    stride: int = 1
    """Global rank r is rank r // stride of this part's group (the experts' strided expert-data groups: the expert
    degree; the dense part: 1)."""

    def rank(self, rank: int) -> int:
        return rank // self.stride


def stage_parts(inventory: ParamInventory, setup: EngineSetup) -> tuple[StagePart, ...]:
    """The dense part, then, with split experts, the experts' part (See [Note: split experts in the engine model])."""
    if setup.expert == 1:
        return (StagePart(inventory, setup),)
    dense = tuple(e for e in inventory.entries if not e.expert)
    experts = tuple(e for e in inventory.entries if e.expert)
    if not any(e.trainable for e in experts):
        raise ValueError(f"expert={setup.expert}, but the inventory marks no trainable expert parameter; record the "
                         "run with zerokit.profiling (its inventory marks split experts), or give expert=1")
    expert_setup = replace(setup, world=setup.world // setup.expert, expert=1, mics_shard_size=None,
                           hpz_partition_size=None, ranks_per_node=None, persistence_threshold=0)
    return (StagePart(replace(inventory, entries=dense), replace(setup, expert=1)),
            StagePart(ParamInventory(experts, source=inventory.source), expert_setup, setup.expert))


def engine_buckets(inventory: ParamInventory, setup: EngineSetup) -> tuple[BucketPlan, ...]:
    """The engine's bucket layout, made by the engine's own function (zerokit/flat/layout.py `build_layout`)
    from the parameters in expected backward order, keyed as the stages key them; with split experts, the dense
    stage's buckets, then the experts' (each bucket split over its own part's ranks)."""
    return tuple(b for part in stage_parts(inventory, setup) for b in stage_buckets(part.inventory, part.setup))


def stage_buckets(inventory: ParamInventory, setup: EngineSetup) -> tuple[BucketPlan, ...]:
    """One stage's buckets: See `engine_buckets`."""
    trainable = [e for e in reversed(inventory.entries) if e.trainable]  # expected backward order
    settings = setup.settings
    if setup.stage == 3:  # one bucket per (unit, param group): See ShardedParameters.build
        groups_per_unit = max((e.group for e in trainable), default=0) + 1
        keys, limit = [e.unit * groups_per_unit + e.group for e in trainable], sys.maxsize
    else:
        keys, limit = [e.group for e in trainable], settings.bucket_numel
    world = settings.layout_world_size
    layout = build_layout([(e.numel, key) for e, key in zip(trainable, keys)], world, bucket_numel=limit)
    return tuple(BucketPlan(b.index, trainable[b.slots[0].param_index].group, trainable[b.slots[0].param_index].unit,
                            b.numel, tuple(slot.numel for slot in b.slots), world) for b in layout.buckets)


@dataclass(frozen=True)
class UnitPlan:
    """A stage-3 unit: its trainable buckets' elements and its frozen buffer, as gathered."""

    index: int
    trainable_numel: int
    frozen_numel: int
    """Padded to a multiple of the world size; 0 without frozen floating parameters."""

    @property
    def gathered_numel(self) -> int:
        return self.trainable_numel + self.frozen_numel


def stage3_units(inventory: ParamInventory, setup: EngineSetup, buckets: tuple[BucketPlan, ...]) -> list[UnitPlan]:
    count = max(e.unit for e in inventory.entries) + 1
    trainable = [0] * count
    for bucket in buckets:
        trainable[bucket.unit] += bucket.numel
    frozen = [0] * count
    for e in inventory.entries:
        if not e.trainable and e.floating:
            frozen[e.unit] += e.numel
    return [UnitPlan(i, trainable[i], round_up(frozen[i], setup.shard_size) if frozen[i] else 0) for i in range(count)]


def persistent_units(units: list[UnitPlan], setup: EngineSetup) -> list[UnitPlan]:
    """Units that stay gathered between steps: smaller than the threshold in all (in practice the root)."""
    return [u for u in units if 0 < u.gathered_numel < setup.persistence_threshold]


@dataclass(frozen=True)
class EngineStates:
    """`engine.memory_stats()` after engine.backward() (gradients at their peak) and after engine.step(), which lets
    every gradient go (See [Note: gradients live from a window's first backward to its step] in
    zerokit/stages/base.py). gradient_buffer: the part made at a window's first backward or reduction and held
    through the rest of the backward (stages 0-1: the flat gradient; stages 2-3: the reduced shard)."""

    after_backward: dict[str, int]
    after_step: dict[str, int]
    gradient_buffer: int


def frozen_bytes(inventory: ParamInventory, setup: EngineSetup, units: list[UnitPlan] | None) -> int:
    p = BYTES_PER_ELEMENT[setup.precision]
    if setup.stage < 3:
        return inventory.fixed_bytes + p * sum(e.numel for e in inventory.entries if not e.trainable and e.floating)
    kept = set() if units is None else {u.index for u in persistent_units(units, setup)}
    shards = sum(u.frozen_numel // setup.shard_size + (u.frozen_numel if u.index in kept else 0) for u in units or ())
    return inventory.fixed_bytes + p * shards


def optimizer_state_bytes(buckets: tuple[BucketPlan, ...], setup: EngineSetup, rank: int = 0) -> int:
    """Masters of the owned shards, and the optimizer's state per piece: each parameter's part of a
    shard is stepped apart, in pieces of at most piece_numel elements, each with its own step count."""
    per_element, has_step = STATE_BYTES[setup.optimizer]
    owned = [b.shard_numel for b in buckets]  # stage 0: world 1, the whole bucket
    masters = 4 * sum(owned) if setup.precision != "fp32" else 0
    parts = [part for b in buckets for part in b.slices(rank % setup.shard_size)]  # its index in its shard group
    pieces = sum(math.ceil(part / setup.piece_numel) for part in parts)
    return masters + per_element * sum(parts) + (4 * pieces if has_step else 0)


def engine_states(inventory: ParamInventory, setup: EngineSetup, rank: int = 0) -> EngineStates:
    """See [Note: the engine's bookkeeping, element by element]; with split experts, the sum of both stages' (See
    [Note: split experts in the engine model])."""
    states = [stage_states(part.inventory, part.setup, part.rank(rank)) for part in stage_parts(inventory, setup)]

    def summed(which: str) -> dict[str, int]:
        return {name: sum(getattr(each, which)[name] for each in states) for name in states[0].after_backward}

    return EngineStates(summed("after_backward"), summed("after_step"), sum(each.gradient_buffer for each in states))


def stage_states(inventory: ParamInventory, setup: EngineSetup, rank: int = 0) -> EngineStates:
    """One stage's model states: See `engine_states`."""
    buckets = stage_buckets(inventory, setup)
    p, r = BYTES_PER_ELEMENT[setup.precision], BYTES_PER_ELEMENT[setup.reduce_dtype]
    numel = sum(b.numel for b in buckets)
    flags = inventory.trainable_count if setup.stage == 0 else 0
    shard = numel // setup.shard_size
    units = stage3_units(inventory, setup, buckets) if setup.stage == 3 else None
    if setup.stage == 3:
        kept = 0 if setup.shards_are_masters else shard  # See [Note: the shard is the fp32 master] in the engine
        parameters = p * (kept + sum(u.trainable_numel for u in persistent_units(units, setup)))
    else:
        parameters = p * numel
    parameters += frozen_bytes(inventory, setup, units)
    widened = setup.precision != setup.reduce_dtype
    if setup.stage >= 2:
        gradients = kept = r * shard
    else:  # the full gradient buffer (stage 0: and the usage flags), and the reduced copies kept in the
        kept = p * (numel + flags)  # reduce dtype until the step
        gradients = kept + (r * shard if widened else 0)
    optimizer = optimizer_state_bytes(buckets, setup, rank)
    held, left = (p * secondary_numel(units, setup, after_step) if units else 0 for after_step in (False, True))
    after_backward = {"parameters": parameters + held, "gradients": gradients, "optimizer_state": optimizer}
    return EngineStates(after_backward, after_backward | {"parameters": parameters + left, "gradients": 0}, kept)


def secondary_numel(units: list[UnitPlan], setup: EngineSetup, after_step: bool) -> int:
    """hpZ's secondary copy (See [Note: hpZ's secondary copy] in zerokit/flat/sharded.py): 1/k of every bucket
    gathered from its primary shards since the shards last changed. After backward that is every unit's trainable
    and frozen buckets (the step's first forward gathered them all) and the persistent units' trainable buckets
    (gathered again when the previous step published them); the step drops them all and its publish gathers the
    persistent units' trainable buckets again: only those are held after it. (A persistent unit's frozen bucket
    stays gathered from start-up and is never gathered again.)"""
    k = setup.settings.secondary_size
    if k == 1:
        return 0
    kept = {u.index for u in persistent_units(units, setup)}
    held = sum(u.trainable_numel if u.index in kept else u.gathered_numel
               for u in units if u.index in kept or not after_step)
    return held // k


def add_count(stats: dict[str, dict[str, int]], kind: str, calls: int, elements: int, element_bytes: int) -> None:
    entry = stats.setdefault(kind, {"calls": 0, "elements": 0, "bytes": 0})
    entry["calls"] += calls
    entry["elements"] += elements
    entry["bytes"] += elements * element_bytes


def group_ranks(group: str, setup: EngineSetup, rank: int) -> list[int]:
    """The global ranks of `rank`'s group named `group` (as comm_stats() names it), in ring order. See [Note: hybrid
    sharding] in zerokit/comm/groups.py: shard groups of s consecutive ranks, replica groups of the ranks with the
    same index in theirs, hpZ's node groups of k consecutive ranks; "shard" and "gather" span every rank."""
    world, s, k = setup.world, setup.settings.shard_size, setup.settings.secondary_size
    parts = {"mics_shard": consecutive_groups(world, s), "mics_gather": consecutive_groups(world, s),
             "mics_replica": strided_groups(world, s), "hpz_gather": consecutive_groups(world, k)}.get(group)
    return list(range(world)) if parts is None else next(part for part in parts if rank in part)


@dataclass
class StepCounts:
    """One rank's collectives of a step, per kind and, once the job spans nodes, per group and across nodes (the
    keys of `engine.comm_stats()`: See [Note: bytes that cross nodes] in zerokit/comm/collectives.py)."""

    setup: EngineSetup
    rank: int
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    cross_node: Fraction = Fraction(0)

    @property
    def spans_nodes(self) -> bool:
        return self.setup.settings.nodes > 1

    def add(self, group: str, kind: str, calls: int, elements: int, element_bytes: int) -> None:
        if not calls and not elements:
            return
        add_count(self.stats, kind, calls, elements, element_bytes)
        if not self.spans_nodes:
            return
        add_count(self.stats, f"{group}.{kind}", calls, elements, element_bytes)
        ranks = group_ranks(group, self.setup, self.rank)
        if ring_crosses_nodes(ranks, self.rank, self.setup.settings.ranks_per_node):
            self.cross_node += ring_share(kind, len(ranks)) * elements * element_bytes

    def result(self) -> dict[str, dict[str, int]]:
        return self.stats | ({"cross_node": {"bytes": round(self.cross_node)}} if self.spans_nodes else {})


def engine_comm(inventory: ParamInventory, setup: EngineSetup, rank: int = 0) -> dict[str, dict[str, int]]:
    """The growth of `engine.comm_stats()` of `rank` over one optimizer step of `setup.grad_accum` micro-steps: per
    kind, and when the job spans nodes per "<group>.<kind>" and the "cross_node" bytes, which differ by rank. One rank
    calls the same collectives (each a local copy, none on a wire) but broadcasts no buffer. With split experts, both
    stages' (See [Note: split experts in the engine model])."""
    dense, *experts = stage_parts(inventory, setup)
    counts = StepCounts(dense.setup, rank)
    stage_collectives(counts, dense.inventory, dense.setup)
    flags = dense.inventory.trainable_count  # one usage flag per trainable parameter
    mics = setup.settings.replicas > 1
    if setup.stage >= 1:  # the float64 sum of squares behind the global norm, and the usage flags
        counts.add("mics_shard" if mics else "shard", "all_reduce", 1, 1 + flags, 8)
    if mics:  # the usage flags again, summed across the replicas
        counts.add("mics_replica", "all_reduce", 1, flags, 8)
    # rank 0's buffers, per dtype, before each forward after the first and at the step (one rank sends none)
    if setup.broadcast_buffers and setup.world > 1:
        for numel, element_bytes in dense.inventory.buffers:  # over the engine's group of every rank
            counts.add("shard", "broadcast", setup.grad_accum, setup.grad_accum * numel, element_bytes)
    for part in experts:
        _expert_collectives(counts, part, rank)
    return counts.result()


def _expert_collectives(counts: StepCounts, part: StagePart, rank: int) -> None:
    """The split experts' stage's collectives added to the dense ones' `counts`, by kind (See [Note: split experts in
    the engine model])."""
    own = StepCounts(part.setup, part.rank(rank))
    stage_collectives(own, part.inventory, part.setup)
    if part.setup.stage >= 1:  # which expert parameters each rank used, over their expert-data group
        own.add("expert_data", "all_reduce", 1, part.inventory.trainable_count, 8)
    else:  # the experts' sum of squares (their flags rode behind their last bucket), over every rank
        counts.add("shard", "all_reduce", 1, 1, 8)
    for kind, entry in own.result().items():
        total = counts.stats.setdefault(kind, {"calls": 0, "elements": 0, "bytes": 0})
        for key in total:
            total[key] += entry[key]


def stage_collectives(counts: StepCounts, inventory: ParamInventory, setup: EngineSetup) -> None:
    """One stage's gradient reductions and parameter gathers (its norm aside): See `engine_comm`."""
    buckets = stage_buckets(inventory, setup)
    p, r = BYTES_PER_ELEMENT[setup.precision], BYTES_PER_ELEMENT[setup.reduce_dtype]
    reductions = setup.grad_accum if setup.reduce_every_step else 1
    kind = "all_reduce" if setup.stage == 0 or not setup.reduces_by_scatter else "reduce_scatter"
    flags = inventory.trainable_count  # one usage flag per trainable parameter
    mics = setup.settings.replicas > 1
    shard = "mics_shard" if mics else "shard"  # See ProcessGroups.for_stage
    for bucket in buckets:
        counts.add(shard, kind, reductions, reductions * bucket.numel, r)
    if setup.stage == 0:  # the flags ride behind the last bucket, in its dtype
        counts.add(shard, kind, 0, flags, r if setup.precision != setup.reduce_dtype else p)
    if mics:  # at the boundary each reduced shard is averaged across the replicas (See [Note: hybrid sharding])
        for bucket in buckets:
            counts.add("mics_replica", "all_reduce", 1, bucket.shard_numel, r)
    if setup.stage in (1, 2):
        for bucket in buckets:
            counts.add(shard, "all_gather", 1, bucket.numel, p)
    if setup.stage == 3:
        _stage3_gathers(counts, inventory, setup, buckets)


def _stage3_gathers(counts: StepCounts, inventory: ParamInventory, setup: EngineSetup,
                    buckets: tuple[BucketPlan, ...]) -> None:
    """A unit is gathered before its forward and, except the root, again before its backward, one call per
    bucket and one for its frozen buffer; a persistent unit only when the step publishes it. With hpZ, each
    bucket's first gather of the step reads the primary shards and every later one the secondary copy inside
    the node group (See [Note: hpZ's secondary copy] in zerokit/flat/sharded.py)."""
    p, m = BYTES_PER_ELEMENT[setup.precision], setup.grad_accum
    gather = "mics_gather" if setup.settings.replicas > 1 else "gather"
    secondary = "hpz_gather" if setup.settings.secondary_size > 1 else gather
    units = stage3_units(inventory, setup, buckets)
    kept = {u.index for u in persistent_units(units, setup)}
    for unit in units:
        own = [b.numel for b in buckets if b.unit == unit.index]
        if unit.index in kept:  # publish_params re-gathers its trainable buckets once per step
            for numel in own:
                counts.add(gather, "all_gather", 1, numel, p)
            continue
        times = m * (1 if unit.index == 0 else 2)
        for numel in own + ([unit.frozen_numel] if unit.frozen_numel else []):
            counts.add(gather, "all_gather", 1, numel, p)
            counts.add(secondary, "all_gather", times - 1, (times - 1) * numel, p)


def per_kind(stats: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The entries of a comm_stats() dict that count every group together (not "<group>.<kind>" or "cross_node")."""
    return {kind: entry for kind, entry in stats.items() if "." not in kind and kind != "cross_node"}


def wire_bytes(stats: dict[str, dict[str, int]], setup: EngineSetup) -> dict[str, float]:
    """Bytes each rank sends per kind on a ring (all-reduce 2(n-1)/n, the others (n-1)/n of the logical size), n
    the ranks of the group each collective went over where `stats` splits them by group, else every rank."""
    wire = {kind: float(ring_share(kind, setup.world) * entry["bytes"]) for kind, entry in per_kind(stats).items()}
    by_group = [(*key.split("."), entry["bytes"]) for key, entry in stats.items() if "." in key]
    for kind in {kind for _, kind, _ in by_group}:
        wire[kind] = float(sum(ring_share(kind, len(group_ranks(group, setup, 0))) * sent
                               for group, other, sent in by_group if other == kind))
    return wire
