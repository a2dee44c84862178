"""What the engine will do, decided once: the choices a config and the back-end make together (whether a
bucket is reduce-scattered or all-reduced, whether gradients leave the rank every micro-step, how many
elements a gradient bucket and an optimizer piece hold). Pure Python, no torch: the stages read these
decisions, and the planner predicts from the very same functions, so the two cannot drift apart.

Below the decisions, the run's settings: one typed part per room (See [Note: each room gets its part]), made by
resolve.py's resolve(config, facts) and handed out by the engine's build.

[Note: each room gets its part]
The config is the user's statement, read and checked once (typed.py; DeepSpeed's keys only in config/dsconfig/, which
records as values what the dict leaves to the run: dsconfig/auto.py's Unknowns). What a run does with it is decided
once more, against the facts of the run (world size, back-end, the launcher's ranks per node and node, the model's
hidden size), by resolve.py's resolve(config, facts), which fills in those values without reading the dict again and
makes a RunSettings: the engine-wide decisions above (`decide`), and one small frozen part per room below the engine.
The facts are read once, by the engine (torchrun's LOCAL_WORLD_SIZE and GROUP_RANK: launcher_ranks_per_node,
launcher_node_rank); the rooms read the nodes from their parts. The engine's build hands each room its part, and no
room below the engine takes or names the whole config: a room's part says everything it may read, so a new config
field reaches a room only by a line in resolve. The planner decides with the same `decide`, from the choices its
setup makes (EngineChoices) and the facts it predicts. benchmarks/config_walk.py traces the walk (and
tests/test_config_walk.py keeps it).
The parts stay torch-free, as this module is the planner's too: a dtype or a torch-bearing policy of typed.py
(MixedPrecision's dtypes, Stage3Policy, LossScaling) travels as it is, typed Any here, named in its comment.

[Note: one place for each engine decision]
Each decision here was once worked out again wherever it was needed (the stages, the engine's blocks, the
planner's engine model, memory and communication models), and the copies had begun to differ. A decision
that needs a value only known on a rank (where one master lives, for the optimizer piece size) is a
function of that value here, called by the engine with it and by the planner with its prediction of it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping

from zerokit.config.defaults import CPU_OPTIMIZER_PIECE_NUMEL
from zerokit.config.dsconfig.blocks import (ActivationCheckpointing, CommsLogger, FlopsProfiler, Monitor, Offload,
                                            Preemption, Wandb)

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


def launcher_ranks_per_node() -> int | None:
    """torchrun's LOCAL_WORLD_SIZE: the ranks it started on this node; None without torchrun. The engine reads it
    once, into its Facts (the planner predicts it)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) >= 1 else None


def launcher_node_rank() -> int | None:
    """torchrun's GROUP_RANK: the node this rank was launched on; None without torchrun."""
    node = os.environ.get("GROUP_RANK", "")
    return int(node) if node.isdigit() else None


def ranks_per_node(configured: int | None, launcher: int | None, world_size: int) -> int:
    """Ranks on each node, numbered consecutively, decided here only: the config's `ranks_per_node` where given, else
    the launcher's (launcher_ranks_per_node, a fact) where it divides the `world_size` ranks, else all on one node."""
    if configured:
        return configured
    return launcher if launcher and world_size % launcher == 0 else world_size


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
    expert_degree: int = 1
    """A stage over MoE experts split across this many ranks (its group, their expert-data group, sums 1/ep of the
    job's gradient: See [Note: ZeRO over experts split across ranks] in zerokit/parallel/experts/share.py); 1: the
    dense stage."""

    def __post_init__(self) -> None:
        if not self.shard_size:
            object.__setattr__(self, "shard_size", self.world_size)
        if not self.ranks_per_node:
            object.__setattr__(self, "ranks_per_node", self.world_size)

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


# ---------------------------------------------------------------------------------------------
# The run's settings: one part per room (See [Note: each room gets its part])
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Facts:
    """What a run's settings need besides the config, known once the process group is up (the planner predicts
    them)."""

    world_size: int
    """The ranks the engine shards over: its data group (every rank without a layout)."""
    backend: str
    """The process group's back-end ("gloo", "nccl", ...)."""
    ranks_per_node: int | None = None
    """The launcher's ranks per node (launcher_ranks_per_node); the config's ranks_per_node wins. None: one node."""
    node_rank: int | None = None
    """The node the launcher started this rank on (torchrun's GROUP_RANK, launcher_node_rank); None: not known."""
    hidden_size: int | None = None
    """The model's hidden size, for the "auto" values that need it (None: unknown)."""
    batch_ranks: int | None = None
    """The ranks the batch identity counts (the tensor ranks too under AutoTP: See [Note: batch sizes under AutoTP
    count the tensor ranks] in parallel/tensor/setup.py); None: world_size."""


@dataclass(frozen=True, kw_only=True)
class EngineChoices:
    """What a config chooses of the engine-wide decisions, in plain values: resolve.py takes them from the
    ZeroConfig, the planner from the setup it prices, and both decide with the same `decide` (See [Note: one place
    for each engine decision])."""

    stage: int
    reduce_scatter: bool | None
    reduce_every_micro_step: bool
    bucket_bytes: int
    reduce_dtype: str
    """The reduce dtype's config name (fp32, bf16, fp16)."""
    mics_shard_size: int | None = None
    hpz_partition_size: int | None = None
    ranks_per_node: int | None = None
    """The config's ranks_per_node; None: the launcher's (a fact)."""


def decide(choices: EngineChoices, facts: Facts) -> EngineSettings:
    """The engine's decisions for these choices on these facts, each a one-line error where a size does not fit."""
    world, stage = facts.world_size, choices.stage
    per_node = ranks_per_node(choices.ranks_per_node, facts.ranks_per_node, world)
    if world % per_node:
        raise ValueError(f"ranks_per_node={per_node} does not divide the world size {world}; give the ranks "
                         "on each node (nodes of equal size, numbered consecutively)")
    shard = shard_group_size(choices.mics_shard_size, world, stage, per_node)
    return EngineSettings(stage=stage, world_size=world,
                          reduce_scatter=reduces_by_scatter(facts.backend, choices.reduce_scatter),
                          reduces_every_micro_step=reduces_every_micro_step(stage, choices.reduce_every_micro_step),
                          bucket_numel=bucket_numel(choices.bucket_bytes, ELEMENT_BYTES[choices.reduce_dtype]),
                          shards_optimizer=stage > 0, shard_size=shard, ranks_per_node=per_node,
                          secondary_size=secondary_group_size(choices.hpz_partition_size, world, stage, shard,
                                                              per_node))


@dataclass(frozen=True, kw_only=True)
class OffloadSettings:
    """tiers/placement.py's part: where masters and stage 3's parameter shards live."""

    optimizer: Offload
    """zero_optimization.offload_optimizer: the fp32 masters, their gradients and optimizer state (stages 1-3)."""
    param: Offload
    """zero_optimization.offload_param: stage 3's parameter shards between gathers."""
    sub_group_size: int | None
    """The optimizer piece size (See [Note: optimizer pieces] in masters/shards.py); NVMe sizes its buffers by it."""
    ranks_per_node: int
    """The ranks whose host memory and NVMe files share a node (tiers/preflight.py checks they all fit)."""
    param_dtype: Any
    """torch.dtype of a master's compute copy on the device (MixedPrecision.param_dtype)."""


@dataclass(frozen=True, kw_only=True)
class StageSettings:
    """The stages' part (stages/): what a stage builds and how it reduces."""

    stage: int
    param_dtype: Any
    """torch.dtype of parameters in forward and backward (MixedPrecision.param_dtype)."""
    reduce_dtype: Any
    """torch.dtype gradients are summed across ranks in (MixedPrecision.reduce_dtype)."""
    sub_group_size: int | None
    units: Any
    """typed.py's Stage3Policy: how stage 3 cuts the model into units (it names nn.Module classes)."""
    checkpoint_units: bool
    """activation_checkpointing.checkpoint_units: stage 3 recomputes every unit's forward in backward."""
    overlaps_reduction: bool
    """Each bucket is reduced during backward (overlap_comm, and always at stage 3)."""
    prescale_gradients: bool
    gradient_predivide_factor: float
    offload: OffloadSettings


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """The optimizer step's part (engine/step.py, precision/scaler.py's loss scaler)."""

    gradient_accumulation_steps: int
    gradient_clipping: float
    """Clip the global norm to this; 0: no clipping."""
    max_consecutive_skipped_steps: int
    loss_scaling: Any
    """typed.py's LossScaling under fp16; None otherwise."""


@dataclass(frozen=True, kw_only=True)
class CommSettings:
    """comm/'s part: every collective's deadline and what the comms logger records."""

    timeout_seconds: float
    logger: CommsLogger


@dataclass(frozen=True, kw_only=True)
class TensorSettings:
    """parallel/'s part (the tensor and sequence degrees), made before the others (the mesh comes before the run's
    facts: See Engine.__init__)."""

    autotp_size: int
    """tensor_parallel.autotp_size: the degree the model's tp_plan is split over; 0 and 1: none."""
    sequence_parallel_size: int = 1
    """sequence_parallel_size: the ranks each replica's sequences are split over (zerokit/parallel/sequence)."""
    expert_parallel_size: int = 1
    """expert_parallel.autoep_size where the block is enabled: the data ranks a Hugging Face MoE model's experts split
    over (zerokit/parallel/experts/hf.py); 1: none."""
    ranks_per_node: int | None
    """The config's ranks_per_node (None: the launcher's, See ranks_per_node): a tensor group stays inside a node."""
    launcher_ranks_per_node: int | None
    """The launcher's (a fact, known before the mesh)."""
    timeout_seconds: float


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """checkpoint/'s part: what a save records and checks."""

    stage: int
    param_dtype: Any
    """torch.dtype the manifest records as the compute dtype."""
    gradient_accumulation_steps: int
    optimizer_kinds: Mapping[Any, str]
    allow_untested_optimizer: bool
    tag_validation: str
    """checkpoint.tag_validation: Ignore, Warn or Fail when ranks pass different tags."""
    async_save: bool
    """checkpoint.async_save: a save returns once the state is in host memory (save_checkpoint's argument overrides)."""
    record: Mapping[str, Any]
    """The config as the manifest records it (its plain fields, dtypes by name): made once, at resolve."""


@dataclass(frozen=True, kw_only=True)
class ObserveSettings:
    """observe/'s part: logs, timers, profilers and monitors."""

    steps_per_print: int | None
    wall_clock_breakdown: bool
    train_batch_size: int | None
    is_fp16: bool
    comms_logger: CommsLogger
    flops_profiler: FlopsProfiler
    csv_monitor: Monitor
    tensorboard: Monitor
    wandb: Wandb


@dataclass(frozen=True, kw_only=True)
class SafeguardSettings:
    """reliability/'s part: the checks at start and the guards of the training loop."""

    stage: int
    units: Any
    """typed.py's Stage3Policy (stage 3's units, which a compiled module must not hold)."""
    ranks_per_node: int
    node_rank: int | None
    """torchrun's GROUP_RANK where the nodes are the launcher's (the config names none or the same size): the node
    consecutive numbering must put this rank on; None: nothing to check."""
    broadcast_buffers: bool
    gradient_accumulation_steps: int
    has_scheduler: bool
    """The config has a `scheduler` block (a forward-only engine refuses to step it)."""
    agreed: tuple[tuple[str, Any], ...]
    """The config's compared fields, flattened (dotted name, value): every rank must hold the same (See [Note: the
    start-up fingerprint] in reliability/fingerprint.py)."""


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Everything a run does with its config, decided once (See [Note: each room gets its part])."""

    decisions: EngineSettings
    stage: StageSettings
    offload: OffloadSettings
    step: StepSettings
    comm: CommSettings
    tensor: TensorSettings
    checkpoint: CheckpointSettings
    observe: ObserveSettings
    safeguards: SafeguardSettings
    activations: ActivationCheckpointing
    preemption: Preemption
    startup_lines: tuple[str, ...] = ()
    """What the start-up log says of the config (ZeroConfig.startup_log_lines), made once with the rest."""
    warnings: tuple[str, ...] = ()
    """The config's warnings for the start-up log: keys ignored, as DeepSpeed ignores them."""


def flattened(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """A dataclass's fields that take part in equality, recursively, as (dotted name, value); anything else is one
    value."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return [(prefix, value)]
    items: list[tuple[str, Any]] = []
    for field in dataclasses.fields(value):
        if field.compare:
            items += flattened(f"{prefix}.{field.name}", getattr(value, field.name))
    return items


__all__ = ["ELEMENT_BYTES", "EngineSettings", "bucket_numel", "optimizer_piece_numel", "reduces_by_scatter",
           "reduces_every_micro_step", "secondary_group_size", "shard_group_size", "consecutive_groups",
           "strided_groups", "ring_crosses_nodes", "ring_share", "launcher_ranks_per_node", "launcher_node_rank",
           "ranks_per_node",
           "Facts", "EngineChoices", "decide", "RunSettings",
           "StageSettings", "OffloadSettings", "StepSettings", "CommSettings", "TensorSettings", "CheckpointSettings",
           "ObserveSettings", "SafeguardSettings", "flattened"]
