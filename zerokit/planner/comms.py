"""Collectives per optimizer step, in the units of `engine.comm_stats()`, and their time.

[Note: communication model]
Each call's size is its full logical tensor, as the engine counts it: all-reduce the tensor,
reduce-scatter its input, all-gather its output. Ring algorithms move, per rank and per direction,
    all-reduce       2 (n-1)/n x bytes   in 2 (n-1) steps
    reduce-scatter     (n-1)/n x bytes   in   (n-1) steps
    all-gather         (n-1)/n x bytes   in   (n-1) steps
so time = wire bytes / (link bandwidth x efficiency) + calls x steps x latency (the alpha-beta
model; the wire factors are nccl-tests' bus-bandwidth factors, doc/PERFORMANCE.md). A group whose
ranks sit in one node uses the intra-node link. A ring over a group that spans nodes enters and leaves each
node once, so one ring's bus bandwidth is about min(intra-node link, the node's NIC total = inter link x
NICs per node); only rings that cross at the same time share the NICs. Those are the groups of the same
kind with ranks on one node: gpus_per_node / (the group's ranks on a node) of them, each NIC total / that
count. A flat group of 16 over 2 nodes of 8 A100s with 4 HDR ports (25 GB/s each): one ring per node,
min(300, 4 x 25) = 100 GB/s, 80 GB/s at 80% efficiency; the 8 replica groups of MiCS/HSDP over the same
nodes (one rank a node each, all crossing at once): 100 / 8 = 12.5 GB/s each, 10 GB/s at 80%, which is
the per-GPU share of the NICs. (The model before this counted the per-GPU share for every group that
spans nodes, 8x too slow for the flat ring.) Tensor-parallel and pipeline groups follow the same rule.

[Note: cross-node bytes per step]
`CommEstimate.cross_node_bytes` is what a rank sends to ranks on other nodes per optimizer step under the
engine's convention ([Note: bytes that cross nodes] in zerokit/comm/collectives.py): each collective runs as
one ring over its group in ascending global rank order; a rank sends its whole ring share (the engine's ring
factor x the logical bytes: 2 (n-1)/n for an all-reduce, (n-1)/n for the rest, broadcast and reduce
included) to the next rank of its ring, which crosses iff that rank is on another node. Nodes hold
consecutive ranks (tp fastest, then dp_shard, replicas, pp). Ranks differ (in a flat group of 4 over
0 1 | 2 3 ranks 1 and 3 send across, 0 and 2 do not), so the planner reports the average over all ranks:
the ring share x the fraction of ranks whose successor is on another node (`Group.cross_fraction`).
The engine reports one rank's own count; the average of its ranks' counts is this figure.

Per step with m micro-steps, trainable Psi_t and all parameters Psi on a rank, N_d ranks sharding:
    stage 0  all-reduce Psi_t gradients once (accumulation runs without communication)
    stage 1  reduce-scatter Psi_t once; all-gather Psi_t updated parameters after the step
    stage 2  reduce-scatter Psi_t every micro-step (or once, see Training.reduce_every_micro_step);
             all-gather Psi_t after the step
    stage 3  every micro-step: all-gather Psi in forward, again in backward (all but the root unit,
             which stays gathered for the step), reduce-scatter Psi_t one unit at a time
Stages 0-2 move 2 Psi per step and stage 3 3 Psi less the root (ZeRO paper Section 7: 1.5x), before
the ring factor. HSDP (MiCS) adds an all-reduce of each gradient shard (Psi_t / N_d) across replicas, once per
step. hpZ (stage 3, a secondary group of k ranks; See [Note: hpZ's secondary copy] in flat/sharded.py): only the
first micro-step's forward gathers over all N_d ranks, every later gather of the step (later micro-steps'
forwards, every backward) over the k ranks; the secondary copy is kept from that first gather, so rebuilding it
after the step costs no collective of its own (whole-tensor optimizers' parameters keep none: they are broadcast
over N_d every time). The reduce-scatter stays over N_d. Sharded stages also
all-reduce one float64 scalar per step, the sum of squared gradients. The engine pads each bucket to a
multiple of N_d, so its counts exceed these by at most N_d - 1 elements per bucket, and it buckets each
optimizer param group apart, so its calls are these times the number of param groups. A whole-tensor
optimizer's parameters (Muon's, Adafactor's: See [Note: whole-tensor optimizers] in memory.py) move the same
elements by other kinds: reduced to their owner (a reduce; on gloo the usual all-reduce) and broadcast from it
instead of all-gathered; a broadcast or reduce moves 1 x bytes per link (nccl-tests' bus factor 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from zerokit.planner.catalogue import Cluster, Link
from zerokit.planner.memory import RankParams, broadcast_gathered, parts, whole_tensor_fraction
from zerokit.planner.models import ModelSpec
from zerokit.planner.spec import Layout, Training
from zerokit.config.settings import ring_share

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "send_recv",
         "host_to_device", "device_to_host", "nvme_read", "nvme_write")  # the last four: offload transfers
PHASES = ("step_start", "first_forward", "forward", "backward", "boundary", "after_step", "critical", "init")
"""step_start: before the step's first micro-batch, exposed (stage 3 under a pipeline gathering once per step);
first_forward: overlaps the first micro-step's forward (hpZ's gathers over every rank; then "forward" holds
the other micro-steps'); forward/backward: overlaps that pass of every micro-step; boundary: overlaps the last backward;
after_step: after the optimizer step, exposed; critical: on the compute path (tensor/pipeline
parallel), exposed; init: once before training."""


def wire_factor(kind: str, n: int) -> float:
    # nccl-tests: broadcast and reduce move the whole tensor through every link of the chain (bus = algorithm bandwidth)
    return {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0, "broadcast": 1.0, "reduce": 1.0}.get(kind, (n - 1) / n)


def engine_ring_factor(kind: str, n: int) -> float:
    """The share of a collective's logical bytes the engine counts a rank as sending (config/settings.py's ring_share):
    broadcast and reduce (n-1)/n there, not the chain's 1 x bytes of their time; a pipeline send all of it."""
    return 1.0 if kind == "send_recv" else float(ring_share(kind, n))


def ring_steps(kind: str, n: int) -> int:
    return {"all_reduce": 2 * (n - 1), "send_recv": 1}.get(kind, n - 1)


@dataclass(frozen=True)
class Group:
    name: str
    size: int
    link: Link
    bandwidth: float
    """bytes/s per rank per direction, efficiency applied."""
    latency: float
    intra_node: bool
    cross_fraction: float = 0.0
    """Share of all ranks whose successor in their ring of this group is on another node
    (See [Note: cross-node bytes per step])."""


@dataclass(frozen=True)
class Collective:
    kind: str
    group: str
    group_size: int
    link: str
    phase: str
    calls: int
    """Per optimizer step (init: once)."""
    elements: int
    bytes: int
    wire_bytes: int
    """Bytes this rank sends per optimizer step: bytes x ring factor."""
    seconds: float
    cross_node_bytes: int = 0
    """Of what a rank sends, the part to ranks on other nodes, averaged over ranks (See [Note: cross-node
    bytes per step])."""


@dataclass(frozen=True)
class CommEstimate:
    collectives: tuple[Collective, ...]

    def per_step(self) -> tuple[Collective, ...]:
        return tuple(c for c in self.collectives if c.phase != "init")

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.per_step())

    @property
    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.per_step())

    @property
    def cross_node_bytes(self) -> int:
        """Bytes a rank sends to other nodes per optimizer step, the average over ranks."""
        return sum(c.cross_node_bytes for c in self.per_step())

    def phase_seconds(self, phase: str) -> float:
        return sum(c.seconds for c in self.collectives if c.phase == phase)

    def phase_calls(self, phase: str) -> int:
        return sum(c.calls for c in self.collectives if c.phase == phase)

    def by_kind(self, groups: tuple[str, ...] = ("dp", "dp_shard", "dp_replicate", "hpz", "ep_data")
                ) -> dict[str, dict[str, int]]:
        """Per optimizer step, in `engine.comm_stats()` form: kind -> calls, elements, bytes (the
        data-parallel collectives the engine issues; tensor/pipeline traffic is on paper only)."""
        stats: dict[str, dict[str, int]] = {}
        for c in self.per_step():
            if c.group in groups:
                entry = stats.setdefault(c.kind, {"calls": 0, "elements": 0, "bytes": 0})
                entry["calls"] += c.calls
                entry["elements"] += c.elements
                entry["bytes"] += c.bytes
        return stats


GROUP_NAMES = ("tp", "dp_shard", "dp_replicate", "dp", "pp", "hpz", "sp", "ep", "ep_data")


def _coordinates(rank: int, layout: Layout, shard: int) -> tuple[int, int, int, int]:
    """(tp, dp_shard, replica, pp) index of a global rank: tp fastest, then dp_shard, replicas, pp."""
    tp_index, rest = rank % layout.tp, rank // layout.tp
    shard_index, rest = rest % shard, rest // shard
    return tp_index, shard_index, rest % layout.replicas, rest // layout.replicas


def _group_key(name: str, rank: int, layout: Layout, shard: int) -> tuple[int, ...]:
    """What the ranks of one group of `name` share: every coordinate the group does not run over."""
    t, s, q, p = _coordinates(rank, layout, shard)
    return {"tp": (s, q, p), "dp_shard": (t, q, p), "dp_replicate": (t, s, p), "dp": (t, p), "pp": (t, s, q),
            "hpz": (rank // layout.secondary,), "sp": (t, s // layout.sp, q, p),
            # experts: blocks of ep consecutive data ranks, and the ranks at one place of every block
            "ep": (t, s // layout.ep, q, p), "ep_data": (t, s % layout.ep, q, p)}[name]


@lru_cache(maxsize=256)
def group_placement(name: str, layout: Layout, shard: int, world: int, per_node: int) -> tuple[int, float]:
    """(most ranks of one group on one node, share of ranks whose ring successor is on another node) for the
    groups of `name` (See [Note: cross-node bytes per step]). The pp group is the ring over the pipeline
    stages, as the send of each activation goes to the next stage."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):  # ascending, so each group's list is in ring order
        groups.setdefault(_group_key(name, rank, layout, shard), []).append(rank)
    crossing, on_one_node = 0, 1
    for ranks in groups.values():
        nodes = [rank // per_node for rank in ranks]
        on_one_node = max(on_one_node, max(nodes.count(node) for node in set(nodes)))
        if len(ranks) > 1:
            crossing += sum(node != nodes[(i + 1) % len(nodes)] for i, node in enumerate(nodes))
    return on_one_node, crossing / world


def make_groups(cluster: Cluster, layout: Layout, shard: int, efficiency: float) -> dict[str, Group]:
    """Each kind of group, with the link and bandwidth its rings get (See [Note: communication model])."""
    sizes = {"tp": layout.tp, "dp_shard": shard, "dp_replicate": layout.replicas, "dp": shard * layout.replicas,
             "pp": layout.pp, "hpz": layout.secondary, "sp": layout.sp, "ep": layout.ep, "ep_data": shard // layout.ep}
    groups = {}
    for name in GROUP_NAMES:
        size = sizes[name]
        on_one_node, crossing = group_placement(name, layout, shard, cluster.world, cluster.gpus_per_node)
        intra = size <= on_one_node
        if intra:
            bandwidth = cluster.intra_link.bandwidth
        else:
            concurrent = math.ceil(cluster.gpus_per_node / on_one_node)  # rings of this kind leaving a node at once
            nics = cluster.inter_link.bandwidth * cluster.nics_per_node
            bandwidth = min(cluster.intra_link.bandwidth, nics / concurrent)
        used = cluster.intra_link if intra else cluster.inter_link
        groups[name] = Group(name, size, used, bandwidth * efficiency, used.latency, intra, crossing)
    return groups


def _collective(kind: str, group: Group, phase: str, calls: int, elements: int, element_bytes: int) -> Collective:
    size = group.size if kind != "send_recv" else 2
    logical = elements * element_bytes
    wire = math.ceil(wire_factor(kind, size) * logical)
    seconds = wire / group.bandwidth + calls * ring_steps(kind, size) * group.latency
    across = math.ceil(engine_ring_factor(kind, size) * logical * group.cross_fraction)
    return Collective(kind, group.name, group.size, group.link.name, phase, calls, elements, logical, wire, seconds,
                      across)


def stage3_blocks(model: ModelSpec, layout: Layout, bucket_elements: int, total: int) -> int:
    """Blocks (units other than the root) on a rank; buckets stand in for them for a bare count."""
    if model.architecture is None:
        return max(1, math.ceil(total / bucket_elements))
    return math.ceil(model.architecture.n_layers / layout.pp)


def _stage3(rank: RankParams, training: Training, group: Group, blocks: int,
            secondary: Group | None = None, once_per_step: bool = False) -> list[Collective]:
    """Per micro-step: the root once and every block before its forward; every block again before its
    backward; one reduce-scatter per unit (zerokit/stages/stage3.py). A whole-tensor optimizer's parameters
    are broadcast from their owner instead of gathered, and their gradients reduced to it. With hpZ
    (`secondary`), every gather after the first micro-step's forward is over the secondary group.
    `once_per_step` (a pipeline's stage3_gathering "step"): every unit gathered once before the schedule and held,
    the reductions per micro-step as before (zerokit/pipeline/engine.py)."""
    m, p, r = training.grad_accum, training.param_bytes, training.reduce_bytes
    root = 1 if rank.root else 0
    in_blocks = rank.total - rank.root
    whole = whole_tensor_fraction(rank, training)
    forward_whole = broadcast_gathered(rank, training)
    backward_whole = in_blocks if forward_whole == in_blocks else round(whole * in_blocks)
    trainable_whole = round(whole * rank.trainable)
    reduce = "reduce_scatter" if training.reduces_by_scatter else "all_reduce"
    scatter = _split(reduce, _whole_reduce(training), group, "backward", m * (root + blocks), m * rank.trainable,
                     m * trainable_whole, r)
    if once_per_step:
        return [*_split("all_gather", "broadcast", group, "step_start", root + blocks, rank.total, forward_whole, p),
                *scatter]
    if secondary is None:
        return [*_split("all_gather", "broadcast", group, "forward", m * (root + blocks), m * rank.total,
                        m * forward_whole, p),
                *_split("all_gather", "broadcast", group, "backward", m * blocks, m * in_blocks, m * backward_whole, p),
                *scatter]
    first = _split("all_gather", "broadcast", group, "first_forward", root + blocks, rank.total, forward_whole, p)
    later = _secondary_gathers(group, secondary, "forward", (m - 1) * (root + blocks), (m - 1) * rank.total,
                               (m - 1) * forward_whole, p)
    backward = _secondary_gathers(group, secondary, "backward", m * blocks, m * in_blocks, m * backward_whole, p)
    return [*first, *later, *backward, *scatter]


def _secondary_gathers(group: Group, secondary: Group, phase: str, calls: int, elements: int, whole: int,
                       element_bytes: int) -> list[Collective]:
    """hpZ's later gathers: all-gathers over the secondary group, except a whole-tensor optimizer's parameters,
    which keep no secondary copy and are broadcast over the shard group again."""
    out = []
    if calls and elements > whole:
        out.append(_collective("all_gather", secondary, phase, calls, elements - whole, element_bytes))
    if calls and whole > 0:
        out.append(_collective("broadcast", group, phase, calls, whole, element_bytes))
    return out


def _whole_reduce(training: Training) -> str:
    """How a whole-tensor parameter's gradient reaches its owner: a reduce, or on gloo the all-reduce every
    bucket gets there (See [Note: reducing a bucket to a shard])."""
    return "reduce" if training.reduces_by_scatter else "all_reduce"


def _split(kind: str, whole_kind: str, group: Group, phase: str, calls: int, elements: int, whole: int,
           element_bytes: int) -> list[Collective]:
    """`elements` moved by `kind`, of which `whole` (a whole-tensor optimizer's parameters) by `whole_kind`."""
    if whole <= 0:
        return [_collective(kind, group, phase, calls, elements, element_bytes)]
    if whole >= elements:
        return [_collective(whole_kind, group, phase, calls, elements, element_bytes)]
    return [_collective(kind, group, phase, calls, elements - whole, element_bytes),
            _collective(whole_kind, group, phase, calls, whole, element_bytes)]


def data_parallel(rank: RankParams, training: Training, stage: int, groups: dict[str, Group],
                  blocks: int, once_per_step: bool = False) -> list[Collective]:
    """The ZeRO collectives of one optimizer step (see [Note: communication model]); `once_per_step`: stage 3's
    gathers under a pipeline holding its units through the step."""
    m, r, g, p = training.grad_accum, training.reduce_bytes, groups, training.param_bytes
    trainable = rank.trainable
    buckets = max(1, math.ceil(trainable / max(1, training.bucket_bytes // r)))
    reduce = "reduce_scatter" if training.reduces_by_scatter else "all_reduce"  # gloo: all-reduce, keep the shard
    out: list[Collective] = []
    if stage == 0:
        if g["dp"].size > 1:
            out.append(_collective("all_reduce", g["dp"], "boundary", buckets, trainable, r))
        return out
    if g["dp_shard"].size > 1:
        whole, shard = round(whole_tensor_fraction(rank, training) * trainable), g["dp_shard"]
        if stage == 3:
            out += _stage3(rank, training, shard, blocks, g["hpz"] if g["hpz"].size > 1 else None, once_per_step)
        elif training.reduces_every_micro_step(stage):  # stage 2 by default
            out += _split(reduce, _whole_reduce(training), shard, "backward", m * buckets, m * trainable, m * whole, r)
        else:
            out += _split(reduce, _whole_reduce(training), shard, "boundary", buckets, trainable, whole, r)
        if stage < 3:
            out += _split("all_gather", "broadcast", shard, "after_step", buckets, trainable, whole, p)
        # the global gradient norm over shards: one float64 sum of squares (zerokit/precision/arithmetic.py sums in
        # float64 so the norm does not depend on the shard layout; the engine reports it every step)
        out.append(_collective("all_reduce", g["dp_shard"], "after_step", 1, 1, 8))
    if g["dp_replicate"].size > 1:
        shard = math.ceil(trainable / g["dp_shard"].size)
        out.append(_collective("all_reduce", g["dp_replicate"], "boundary", buckets, shard, r))
    return out


def model_parallel(model: ModelSpec, training: Training, layout: Layout, groups: dict[str, Group]) -> list[Collective]:
    """Megatron tensor parallelism: two all-reduces of the (s, b, h) activations per block in
    forward and two in backward (Shoeybi et al. 2019, Section 3), two more when the forward is
    recomputed; Ulysses sequence parallelism: four all-to-alls of a rank's tokens per block each way (Jacobs et al.
    2023); pipeline parallelism: one activation forward and one gradient back per micro-batch."""
    arch, out = model.architecture, []
    if arch is None or (layout.tp == 1 and layout.pp == 1 and layout.sp == 1 and layout.ep == 1):
        return out
    m, e = training.grad_accum, training.act_bytes
    activation = training.tokens_per_micro_batch * arch.hidden
    if layout.tp > 1:
        per_block = 4 + (2 if training.checkpointing == "full" else 0)
        calls = m * per_block * math.ceil(arch.n_layers / layout.pp)
        out.append(_collective("all_reduce", groups["tp"], "critical", calls, calls * activation, e))
    if layout.sp > 1:
        # Ulysses: per block, the query, key, value and attention output each cross the sequence group once forward
        # and once back (again where the forward is recomputed), an all-to-all of the rank's s / sp tokens
        passes = 2 + (1 if training.checkpointing == "full" else 0)
        per_block = training.tokens_per_micro_batch // layout.sp * (2 * arch.q_dim + 2 * arch.kv_dim)
        calls = m * passes * 4 * arch.n_layers
        out.append(_collective("all_to_all", groups["sp"], "critical", calls, m * passes * arch.n_layers * per_block,
                               e))
    if layout.ep > 1 and arch.experts is not None:
        out.append(expert_exchange(model, training, groups["ep"]))
    if layout.pp > 1:
        # each micro-batch's activation goes forward and its gradient back across each of the p - 1 boundaries: a GPU
        # sends 2m(p-1)/p of them on average (the first stage m forward, the last m back, the others 2m)
        elements = math.ceil(activation / layout.tp)
        sent = round(2 * m * elements * (layout.pp - 1) / layout.pp)
        out.append(_collective("send_recv", groups["pp"], "critical", 2 * m, sent, e))
    return out


def expert_exchange(model: ModelSpec, training: Training, group: Group) -> Collective:
    """[Note: the expert exchange in the plan] Per MoE layer and micro-batch, forward sends each routed token to its
    expert's rank (dispatch) and back (combine): two all-to-alls over the expert group of tokens x top-k x capacity x
    hidden elements, (ep - 1) / ep of them leaving the rank; backward sends their gradients the same two ways, and a
    recomputed forward (full checkpointing) repeats its two. On the compute path: nothing overlaps them."""
    calls, elements = expert_exchange_size(model, training)
    return _collective("all_to_all", group, "critical", calls, elements, training.act_bytes)


def expert_exchange_size(model: ModelSpec, training: Training) -> tuple[int, int]:
    """(calls, elements) per optimizer step of [Note: the expert exchange in the plan], elements in the activation
    dtype."""
    arch, m = model.architecture, training.grad_accum
    x = arch.experts
    passes = 2 + (1 if training.checkpointing == "full" else 0)
    calls = m * passes * 2 * arch.moe_layers
    routed = math.ceil(training.tokens_per_micro_batch * x.top_k * x.capacity)
    return calls, calls * routed * arch.hidden


def sharded_parts(model: ModelSpec, rank: RankParams, layout: Layout, groups: dict[str, Group],
                  blocks: int) -> list[tuple[RankParams, dict[str, Group], int]]:
    """Each part of the rank's parameters with the groups ZeRO runs it over and its stage-3 blocks: the dense part
    over the data group, the experts over their expert-data group (See [Note: the expert degree] in memory.py)."""
    split = parts(rank)
    if len(split) == 1:
        return [(rank, groups, blocks)]
    dense, experts = split
    expert_groups = {**groups, "dp_shard": groups["ep_data"], "dp": groups["ep_data"]}
    moe_blocks = math.ceil(model.architecture.moe_layers / layout.pp)
    return [(dense, groups, blocks), (experts, expert_groups, moe_blocks)]


def communication(model: ModelSpec, rank: RankParams, training: Training, layout: Layout, stage: int,
                  cluster: Cluster, efficiency: float) -> CommEstimate:
    groups = make_groups(cluster, layout, rank.shard, efficiency)
    blocks = stage3_blocks(model, layout, max(1, training.bucket_bytes // training.reduce_bytes), rank.total)
    collectives = []
    for part, part_groups, part_blocks in sharded_parts(model, rank, layout, groups, blocks):
        collectives += data_parallel(part, training, stage, part_groups, part_blocks,
                                     training.gathers_once_per_step(stage, layout))
    collectives += model_parallel(model, training, layout, groups)
    if groups["dp"].size > 1:  # rank 0's parameters reach every replica once, before training
        collectives.append(_collective("broadcast", groups["dp"], "init", 1, rank.total, training.param_bytes))
    return CommEstimate(tuple(collectives))


def _overlapped(comm: float, compute: float, calls: int) -> float:
    """Exposed part of `comm` run beside `compute`: at least one call (the first gather or the
    last reduction) cannot overlap."""
    if comm <= 0:
        return 0.0
    return max(comm - compute, comm / max(1, calls))


def exposed_seconds(comm: CommEstimate, forward: float, backward: float, micro_steps: int) -> float:
    """Communication time not hidden behind compute, per optimizer step. `forward`/`backward` are
    one micro-step's compute seconds."""
    m = micro_steps
    first, first_calls = comm.phase_seconds("first_forward"), comm.phase_calls("first_forward")
    rest = m - 1 if first_calls else m  # micro-steps whose forward gathers are in "forward"
    fwd = comm.phase_seconds("forward") / rest if rest else 0.0
    fwd_calls = comm.phase_calls("forward") // rest if rest else 0
    bwd, bwd_calls = comm.phase_seconds("backward") / m, comm.phase_calls("backward") // m
    boundary, boundary_calls = comm.phase_seconds("boundary"), comm.phase_calls("boundary")
    exposed = _overlapped(first, forward, first_calls) + rest * _overlapped(fwd, forward, fwd_calls)
    exposed += (m - 1) * _overlapped(bwd, backward, bwd_calls)
    exposed += _overlapped(bwd + boundary, backward, bwd_calls + boundary_calls)
    return (exposed + comm.phase_seconds("step_start") + comm.phase_seconds("after_step")
            + comm.phase_seconds("critical"))
