"""Typed, validated configuration, readable from DeepSpeed-style JSON.

A config can be given three ways and always ends up as one frozen `ZeroConfig`: a `ZeroConfig` object, a dict
with DeepSpeed's keys, or the path of a JSON file holding that dict. Dicts are read by zerokit.config.dsconfig, the
one place DeepSpeed's keys are known (the planner's translator reads them there too): every key of
DeepSpeed's schema is honoured, accepted because zerokit always does that (named in the start-up log), or
refused in one line naming the key, what it asks for and why zerokit does not offer it. A misspelt key is
refused with the closest accepted one, because a silently ignored knob is how a run trains wrong without
anyone noticing.

"auto" values (Hugging Face templates) are resolved at the dict level (zerokit/config/dsconfig/auto.py), before the
typed config is built (`typed_fields`, one table from keys to fields: FIELDS): at once where they need nothing more.
What needs the world size or the model the reader records as values (`Unknowns`), and `ZeroConfig.resolve(world_size=,
hidden_size=)` fills it in from them and the config's own fields, without reading the dict again: the dict is read
once. `startup_log_lines()` then says what zerokit chose. A field's default is the schema's default for its key
(config/dsconfig/schema*.py), except where a comment says why zerokit's differs. The run's settings are made from a
resolved config in resolve.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from zerokit.config.defaults import DEFAULT_BUCKET_BYTES
from zerokit.config.dsconfig import AUTO, DeepSpeedConfig, read
from zerokit.config.dsconfig.auto import (GAS, HIDDEN_KEYS, MICRO, TBS, Choice, Unknowns, default_differences,
                                          derive_batch, fill, hidden_size_of, unknowns,
                                          unset_differing_defaults)
from zerokit.config.dsconfig.auto import resolve as resolve_auto
from zerokit.config.dsconfig.blocks import (ActivationCheckpointing, CommsLogger, FlopsProfiler, Monitor, Offload,
                                     OptimizerSpec, Preemption, Resume, SchedulerSpec, Wandb, block_fields,
                                     tensorboard_available)
from zerokit.config.dsconfig.precision import compute_dtype
from zerokit.config.dsconfig.schema import default
from zerokit._support.jsonfile import read_json_object
from zerokit.config.settings import ELEMENT_BYTES

DTYPES_BY_NAME = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
"""The config name of each floating dtype the engine computes or communicates in."""
Z = "zero_optimization."


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Which dtypes a step computes and communicates in."""

    param_dtype: torch.dtype = torch.float32
    """dtype of the model's parameters during forward and backward (and of their gradients)."""
    reduce_dtype: torch.dtype = torch.float32
    """dtype gradients are summed across ranks in; fp32 by default so that many ranks do not lose bits."""

    def __post_init__(self) -> None:
        accepted = (torch.float32, torch.bfloat16, torch.float16)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in accepted:
                raise ValueError(f"{name}={getattr(self, name)} is not supported; use one of fp32, bf16, fp16")


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """Loss scaling for fp16 (DeepSpeed's `fp16` block); bf16 and fp32 need none."""

    static_scale: float | None = None
    """A fixed scale (DeepSpeed `loss_scale` > 0); None means dynamic scaling."""
    initial_scale_power: int = default("fp16.initial_scale_power")
    """Dynamic scaling starts at 2**initial_scale_power."""
    window: int = default("fp16.loss_scale_window")
    """Steps without overflow before the scale doubles (DeepSpeed `loss_scale_window`)."""
    hysteresis: int = default("fp16.hysteresis")
    """Overflows tolerated before the scale is halved (the step is skipped either way)."""
    min_scale: float = default("fp16.min_loss_scale")
    """The scale never goes below this (DeepSpeed `min_loss_scale`)."""

    def __post_init__(self) -> None:
        if self.static_scale is not None and self.static_scale <= 0:
            raise ValueError(f"fp16.loss_scale={self.static_scale} must be 0 (dynamic) or a positive number")
        if self.window < 1 or self.hysteresis < 1:
            raise ValueError("fp16.loss_scale_window and fp16.hysteresis must be >= 1")
        if self.min_scale <= 0:
            raise ValueError(f"fp16.min_loss_scale={self.min_scale} must be > 0")


@dataclass(frozen=True, kw_only=True)
class Stage3Policy:
    """How stage 3 splits the model into units and how many full parameters may be live at once.
    Sizes are in elements, like DeepSpeed's stage3_* keys."""

    unit_classes: tuple[str, ...] = ()
    """Names of module classes whose instances become units, e.g. "LlamaDecoderLayer" (the exact class
    name; subclasses do not match); a single string is one name. Named units, here or in `units`, may
    nest (a Block and the attention inside it): each is its own unit, and the outer one owns only what
    the inner ones do not (See [Note: nested units] in zerokit/stages/units.py). A name that matches no
    module raises. With neither unit_classes nor units, auto-wrap: every member of an nn.ModuleList or
    nn.Sequential with at least min_unit_params parameters becomes a unit (transformer blocks,
    typically), nothing inside such a unit is searched (no nesting), and the root takes the rest."""
    units: tuple[type[torch.nn.Module] | torch.nn.Module, ...] = ()
    """Module classes (every instance, subclasses included) and module instances that become units,
    besides those named in unit_classes; a single class or module is one entry. Typed config only:
    JSON carries names, in stage3_unit_classes. Each must match a module of the model, or it raises."""
    min_unit_params: int = default(Z + "stage3_min_unit_params")
    """Auto-wrap only: the fewest parameters a ModuleList/Sequential member needs to become a unit."""
    max_live_parameters: int = default(Z + "stage3_max_live_parameters")
    """Never hold more than this many unsharded parameter elements at once (DeepSpeed
    stage3_max_live_parameters); prefetches that would exceed it wait."""
    prefetch_numel: int = default(Z + "stage3_prefetch_bucket_size")
    """Gather the next units ahead of use while their total stays under this (stage3_prefetch_bucket_size)."""
    persistence_threshold: int = default(Z + "stage3_param_persistence_threshold")
    """Parameters with fewer elements join the root unit and stay gathered for the whole step; a unit
    smaller than this in all stays gathered between steps too, which, since every small parameter is the
    root's, only the root can be (stage3_param_persistence_threshold; See [Note: small parameters stay
    with the root] in zerokit/stages/units.py)."""

    skipped_units: str = "raise"
    """When the ranks ask for different units at one gather (a module that runs on some ranks only): "raise"
    names the module each rank asked for, at that gather, on every rank; "gather" makes every rank gather it,
    for a cost (See [Note: stage-3 units every rank agrees on] in zerokit/stages/agreement.py)."""

    def __post_init__(self) -> None:
        if self.skipped_units not in ("raise", "gather"):
            raise ValueError(f"stage3 skipped_units={self.skipped_units!r} is not a policy; "
                             "use \"raise\" or \"gather\"")
        # A bare string would otherwise be read as the tuple of its letters, a bare class as an error.
        object.__setattr__(self, "unit_classes", self._entries(self.unit_classes, (str,)))
        object.__setattr__(self, "units", self._entries(self.units, (type, torch.nn.Module)))
        for name in self.unit_classes:
            if not isinstance(name, str) or not name:
                raise ValueError(f"stage3 unit_classes entry {name!r} is not a class name; give names like "
                                 "\"LlamaDecoderLayer\" there and classes or module instances in units")
        for item in self.units:
            if not isinstance(item, torch.nn.Module) and not (isinstance(item, type)
                                                               and issubclass(item, torch.nn.Module)):
                raise ValueError(f"stage3 units entry {item!r} is neither an nn.Module class nor a module "
                                 "instance; give class names in unit_classes")
        for name in ("min_unit_params", "max_live_parameters", "prefetch_numel", "persistence_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"stage3 {name}={getattr(self, name)} must be >= 0")

    @staticmethod
    def _entries(value: Any, single: tuple[type, ...]) -> tuple[Any, ...]:
        """One entry or a collection of them, as a tuple (hashable, like the frozen config around it)."""
        if isinstance(value, (list, tuple, set, frozenset)) and not isinstance(value, single):
            return tuple(value)
        return (value,)  # a single entry; a wrong type is named by the checks that follow


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Everything `zerokit.initialize` needs to know about how to train."""

    stage: int = default(Z + "stage")
    """0: plain data parallel; 1: shard optimizer state; 2: also gradients; 3: also parameters."""
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    loss_scaling: LossScaling | None = None
    """Set (and only set) when param_dtype is fp16."""
    gradient_accumulation_steps: int = 1  # the schema's None means "derive it": a typed config derives nothing
    """Micro-steps per optimizer step; the loss is divided by this in `engine.backward`."""
    gradient_clipping: float = default("gradient_clipping")  # DeepSpeed 0.19.8 clips at 1.0: See default_differences
    """Clip the global gradient norm (across all shards) to this value; 0 disables clipping."""
    # torch DDP's 25 MiB, not DeepSpeed's 5e8 elements (2 GB of fp32, one bucket for most models, reduced after
    # backward)
    reduce_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Gradients are reduced in buckets of about this many bytes (in reduce_dtype)."""
    sub_group_size: int | None = default(Z + "sub_group_size")
    """The optimizer steps each fp32 master in pieces of at most this many elements (DeepSpeed's
    sub_group_size). None: 65536 on the CPU, whole parameters on a GPU; 0: whole parameters everywhere, as
    DeepSpeed's 0 makes every parameter its own sub-group. See [Note: optimizer pieces]."""
    reduce_scatter: bool | None = default(Z + "reduce_scatter")
    """Stages 1-3: True reduce-scatters each gradient bucket; False all-reduces it and keeps this rank's
    shard (DeepSpeed's reduce_scatter key). None: reduce-scatter, except on gloo, whose reduce-scatter
    is slower than its all-reduce. See [Note: reducing a bucket to a shard]."""
    overlap_comm: bool = default(Z + "overlap_comm")  # DeepSpeed's only at stage 3: See default_differences
    """Stages 0-2: launch each bucket's reduction during backward as soon as it is full (false: after backward).
    Stage 3 always reduces each unit during backward, as it frees the unit's gradients; false is accepted and
    logged there, as it changes only when a reduction starts, never what it sums."""
    reduce_every_micro_step: bool = default(Z + "reduce_every_micro_step")
    """Stage 2 only. True: reduce-scatter on every micro-step, so a rank never holds more than its
    gradient shard plus in-flight buckets (the ZeRO-2 memory promise; costs one reduce-scatter per
    micro-step). False: accumulate full gradients locally and reduce once per optimizer step (stage-1
    gradient memory during accumulation; one reduce-scatter per step)."""
    stage3: Stage3Policy = field(default_factory=Stage3Policy)
    max_consecutive_skipped_steps: int = default("max_consecutive_skipped_steps")
    """Training raises after this many optimizer steps in a row were skipped for inf/nan gradients."""
    train_batch_size: int | None = default(TBS)
    """Optional check: must equal micro batch x accumulation steps x world size."""
    train_micro_batch_size_per_gpu: int | None = default(MICRO)
    offload_optimizer: Offload = field(default_factory=Offload)
    """Where fp32 masters, their gradients and optimizer state live (stages 1-3)."""
    offload_param: Offload = field(default_factory=lambda: Offload(buffer_count=5))
    """Where sharded parameters live between uses (stage 3 only)."""
    allgather_bucket_size: int = default(Z + "allgather_bucket_size")
    """DeepSpeed's all-gather staging size, read and checked only: zerokit gathers each bucket's updated
    parameters in place into the flat buffer, so there is no staging buffer for it to bound."""
    allgather_partitions: bool = default(Z + "allgather_partitions")
    """DeepSpeed's choice of all-gather (true) or broadcasts (false) for updated parameters, read and logged
    only: zerokit picks the gather per back-end, and either way every rank ends with the same values."""
    allow_untested_optimizer: bool = default("zero_allow_untested_optimizer")
    """Accept a passed optimizer zerokit's tests do not cover (DeepSpeed's zero_allow_untested_optimizer)."""
    optimizer_kinds: Mapping[Any, str] = field(default_factory=dict)
    """Typed config only: optimizer classes (or class names) zerokit does not know, declared "elementwise"
    (sharded by position) or "whole_tensor" (each parameter stepped whole by one rank). See [Note:
    element-wise and whole-tensor optimizers] in zerokit/masters/optimizer.py."""
    optimizer: OptimizerSpec | None = None
    """The `optimizer` block: what to build when initialize() is given no optimizer."""
    scheduler: SchedulerSpec | None = None
    """The `scheduler` block: the LR schedule to build and step at each optimizer step."""
    activation_checkpointing: ActivationCheckpointing = field(default_factory=ActivationCheckpointing)
    steps_per_print: int | None = default("steps_per_print")
    """Log loss, LR, grad norm, loss scale, skips and step time every this many optimizer steps."""
    wall_clock_breakdown: bool = default("wall_clock_breakdown")
    """Time forward, backward, reduction and optimizer step."""
    comms_logger: CommsLogger = field(default_factory=CommsLogger)
    flops_profiler: FlopsProfiler = field(default_factory=FlopsProfiler)
    csv_monitor: Monitor = field(default_factory=Monitor)
    tensorboard: Monitor = field(default_factory=Monitor)
    wandb: Wandb = field(default_factory=Wandb)
    prescale_gradients: bool = default("prescale_gradients")
    """Divide gradients by the world size before the reduction instead of after (DeepSpeed's meaning)."""
    gradient_predivide_factor: float = default("gradient_predivide_factor")
    """With prescale_gradients False: divide by this before the reduction and by world size / this after."""
    grad_accum_dtype: torch.dtype | None = None
    """dtype gradients accumulate in across micro-steps (data_types.grad_accum_dtype); None: as today."""
    dataloader_drop_last: bool = default("dataloader_drop_last")
    """Drop the last incomplete batch of a loader built from training_data."""
    comm_timeout_seconds: float = default("comm_timeout_seconds")
    """Every collective's deadline; a collective still waiting after this raises."""
    broadcast_buffers: bool = default("broadcast_buffers")
    """Broadcast rank 0's module buffers to every rank, as torch DDP does."""
    mics_shard_size: int = default(Z + "mics_shard_size")
    """Stages 1-3: shard over groups of this many consecutive ranks, replicated across the groups (DeepSpeed's MiCS,
    FSDP's HSDP; See [Note: hybrid sharding] in comm/groups.py); -1: one group over every rank."""
    hpz_partition_size: int = default(Z + "zero_hpz_partition_size")
    """Stage 3: ZeRO++ hpZ, a secondary copy of the parameter shards split over groups of this many consecutive
    ranks, which every gather after the first of a step reads (See [Note: hpZ's secondary copy] in
    flat/sharded.py); 1: none."""
    preemption: Preemption = field(default_factory=Preemption)
    """zerokit's `preemption` block: save and exit with a requeue code on SIGTERM/SIGUSR1 (off by default)."""
    resume: Resume = field(default_factory=Resume)
    """zerokit's `resume` block: at initialize, load the newest complete checkpoint in resume.load_dir (off by
    default)."""
    autotp_size: int = default("tensor_parallel.autotp_size")
    """DeepSpeed's AutoTP training: the tensor degree the model's Hugging Face tp_plan is split over, inside a node,
    with ZeRO over the replicas (zerokit/parallel/tensor); 0 and 1: none."""
    ranks_per_node: int | None = default("ranks_per_node")
    """Ranks on each node, numbered consecutively. None: torchrun's LOCAL_WORLD_SIZE, else one node (the start-up
    fingerprint checks that every rank agrees on the outcome)."""
    expert_parallel_size: int = 1
    """AutoEP's expert degree: expert_parallel.autoep_size where enabled (zerokit/parallel/experts/hf.py); 1: none."""
    sequence_parallel_size: int = default("sequence_parallel_size")
    """Ulysses sequence parallelism: each replica's sequences split over this many consecutive ranks (DeepSpeed's
    sequence_parallel_size; zerokit/parallel/sequence); 1: none."""
    tag_validation: str = default("checkpoint.tag_validation")
    """When ranks pass different tags to save_checkpoint (rank 0's is saved under): "Ignore", "Warn" or "Fail"
    (DeepSpeed's checkpoint.tag_validation)."""
    checkpoint_async_save: bool = default("checkpoint.async_save")
    """save_checkpoint writes in the background once this rank's state is in host memory (zerokit's
    checkpoint.async_save; save_checkpoint's async_save/asynchronous arguments override it)."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """Start-up log lines from reading the config: keys accepted because zerokit always does that, aliases."""
    warnings: tuple[str, ...] = field(default=(), compare=False)
    """Start-up warnings from reading the config: keys ignored, as DeepSpeed ignores them."""
    auto_choices: tuple[Choice, ...] = field(default=(), compare=False)
    """What "auto" (and absent batch keys) resolved to."""
    pending_auto: tuple[str, ...] = field(default=(), compare=False)
    """Keys whose value needs the world size or the model: see resolve()."""
    unknowns: Unknowns | None = field(default=None, compare=False, repr=False)
    """What the DeepSpeed config this was read from leaves to the world size and the model, recorded where it was
    read (config/dsconfig/auto.py): resolve() fills it in without reading the dict again. None for a typed config, and
    once resolved."""
    unset_defaults: tuple[str, ...] = field(default=(), compare=False)
    """Keys the DeepSpeed config left unset whose default differs from DeepSpeed's (the start-up log says so)."""
    source: DeepSpeedConfig | None = field(default=None, compare=False, repr=False)
    """The DeepSpeed config this was read from (None for a typed config), kept for the caller: zerokit reads it once,
    in from_dict."""

    def __post_init__(self) -> None:
        if self.precision.param_dtype == torch.float16 and self.loss_scaling is None:
            object.__setattr__(self, "loss_scaling", LossScaling())
        check_config(self)

    @property
    def overlaps_reduction(self) -> bool:
        """Whether each bucket is reduced during backward: overlap_comm, except at stage 3, which always is."""
        return self.overlap_comm or self.stage == 3

    @property
    def is_fp16(self) -> bool:
        return self.precision.param_dtype == torch.float16

    def check_batch_sizes(self, world_size: int) -> None:
        """DeepSpeed's batch identity, checked once the world size is known (missing sizes are derived as
        DeepSpeed derives them, so a train_batch_size that cannot be split over the ranks is an error)."""
        if self.pending_auto:
            raise ValueError(f"{', '.join(self.pending_auto)} need the world size or the model's hidden size; call "
                             "config.resolve(world_size=..., hidden_size=...) before training")
        if self.train_batch_size is None and self.train_micro_batch_size_per_gpu is None:
            return
        derive_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps,
                     world_size)

    def resolve(self, world_size: int, hidden_size: int | None = None) -> ZeroConfig:
        """This config with every "auto" filled in for this world size and model (hidden_size: see
        hidden_size_of), batch sizes derived, and the batch identity checked; auto_choices says what was
        chosen. What the DeepSpeed config left unknown was recorded where it was read (`unknowns`), so the dict is
        not read again: the values come from this config's own fields, and a field changed with replace() since
        reading keeps its value (what is derived from it agrees). A typed config has nothing to fill in and is only
        checked; so has a resolved one."""
        if self.unknowns is None:
            self.check_batch_sizes(world_size)
            return self
        values, choices = fill(self._unknowns_now(), world_size, hidden_size)
        resolved = replace(self, **self._typed_values(values), pending_auto=(), unknowns=None,
                           auto_choices=self.auto_choices + tuple(choices))
        resolved.check_batch_sizes(world_size)
        return resolved

    def _unknowns_now(self) -> Unknowns:
        """`unknowns` with this config's own values: the batch sizes it holds (the accumulation steps unknown only
        while they are the default a read config holds for a derived value), the hidden-size keys still at the
        default a read "auto" leaves, the reduce dtype it reduces in."""
        unknown = self.unknowns
        read_gas = dict(unknown.batch)[GAS]
        gas = None if read_gas is None and self.gradient_accumulation_steps == 1 else self.gradient_accumulation_steps
        untouched = [path for path in unknown.hidden_keys
                     if _field(self, HIDDEN_FIELDS[path]) == _read_auto_value(HIDDEN_FIELDS[path])]
        return replace(unknown, batch=((TBS, self.train_batch_size), (MICRO, self.train_micro_batch_size_per_gpu),
                                       (GAS, gas)),
                       hidden_keys=tuple(untouched), reduce_dtype=DTYPE_NAMES[self.precision.reduce_dtype])

    def _typed_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """`fill`'s values by key as this config's fields: the bucket from elements to bytes of the reduce dtype, the
        stage-3 sizes into the Stage3Policy."""
        typed: dict[str, Any] = {}
        stage3: dict[str, Any] = {}
        for path, value in values.items():
            if path == HIDDEN_KEYS[0]:
                typed["reduce_bucket_bytes"] = value * _element_size(self.precision.reduce_dtype)
            elif FIELDS[path].startswith("stage3."):
                stage3[FIELDS[path].removeprefix("stage3.")] = value
            else:
                typed[FIELDS[path]] = value
        return {**typed, "stage3": replace(self.stage3, **stage3)} if stage3 else typed

    def startup_log_lines(self) -> list[str]:
        """What the start-up log should say about the config: keys accepted because zerokit always does that,
        aliases read as their key, what "auto" resolved to, and zerokit defaults that differ from DeepSpeed's."""
        return startup_log_lines(self)


# ---------------------------------------------------------------------------------------------
# Checks, run where the config is built (ZeroConfig.__post_init__)
# ---------------------------------------------------------------------------------------------

def check_config(config: ZeroConfig) -> None:
    """Every rule a ZeroConfig keeps, each broken one a one-line ValueError naming the value and what is accepted."""
    _check_step(config)
    _check_offload(config)
    _check_sizes(config)
    if config.tensorboard.enabled:
        tensorboard_available()


def _check_step(config: ZeroConfig) -> None:
    """The training loop's settings: stage, accumulation, clipping, skips, loss scaling, when to reduce, logging,
    deadline."""
    if isinstance(config.stage, bool) or config.stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage={config.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    if config.gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={config.gradient_accumulation_steps} must be >= 1")
    if config.gradient_clipping < 0:
        raise ValueError(f"gradient_clipping={config.gradient_clipping} must be >= 0 (0 disables clipping)")
    if config.max_consecutive_skipped_steps < 1:
        raise ValueError("max_consecutive_skipped_steps must be >= 1")
    if config.precision.param_dtype != torch.float16 and config.loss_scaling is not None:
        raise ValueError("loss scaling is only for fp16; bf16 and fp32 gradients do not underflow that way")
    if not config.reduce_every_micro_step and config.stage != 2:
        raise ValueError("reduce_every_micro_step=False is a stage-2 choice; stages 0-1 never reduce "
                         "before the accumulation boundary and stage 3 always reduces every micro-step")
    if config.steps_per_print is not None and config.steps_per_print < 1:
        raise ValueError(f"steps_per_print={config.steps_per_print} must be >= 1")
    if not config.gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor={config.gradient_predivide_factor} must be > 0")
    if not (math.isfinite(config.comm_timeout_seconds) and config.comm_timeout_seconds > 0):
        raise ValueError(f"comm_timeout_seconds={config.comm_timeout_seconds} must be a positive number of seconds")
    if config.grad_accum_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"data_types.grad_accum_dtype={config.grad_accum_dtype} is not supported; use fp32, bf16 "
                         "or fp16")


def _check_offload(config: ZeroConfig) -> None:
    if config.offload_param.enabled and config.stage != 3:
        raise ValueError(f"zero_optimization.offload_param.device={config.offload_param.device} needs stage 3 "
                         f"(only stage 3 shards parameters); zero_optimization.stage={config.stage}")
    optimizer = config.offload_optimizer
    # DeepSpeed offers NVMe and Twin-Flow (ratio) at stage 3 only; zerokit's tiers serve stages 1-3 alike
    if optimizer.enabled and config.stage == 0:
        raise ValueError(f"zero_optimization.offload_optimizer.device={optimizer.device} needs stage 1, 2 or 3, "
                         "which shard the optimizer state it moves")


def _check_sizes(config: ZeroConfig) -> None:
    """Buckets, optimizer pieces and the group sizes of MiCS, hpZ and the nodes."""
    if config.reduce_bucket_bytes < 1:
        raise ValueError(f"reduce_bucket_bytes={config.reduce_bucket_bytes} must be a positive byte count")
    if config.sub_group_size is not None and config.sub_group_size < 0:
        raise ValueError(f"zero_optimization.sub_group_size={config.sub_group_size} must be an element count >= 0 "
                         "(0: one optimizer piece per parameter)")
    if config.allgather_bucket_size < 1:
        raise ValueError(f"zero_optimization.allgather_bucket_size={config.allgather_bucket_size} must be > 0")
    mics = config.mics_shard_size
    if isinstance(mics, bool) or not (mics == -1 or mics >= 1):
        raise ValueError(f"zero_optimization.mics_shard_size={mics!r} is not a shard group size; "
                         "use a positive divisor of the world size, or -1 for one group over every rank")
    if mics != -1 and config.stage == 0:
        raise ValueError(f"zero_optimization.mics_shard_size={mics} needs stage 1, 2 or 3 (stage 0 "
                         "shards nothing); zero_optimization.stage=0")
    if isinstance(config.hpz_partition_size, bool) or config.hpz_partition_size < 1:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size={config.hpz_partition_size!r} is not a group "
                         "size; use a positive divisor of the world size, or 1 for no secondary copy")
    per_node = config.ranks_per_node
    if per_node is not None and (isinstance(per_node, bool) or per_node < 1):
        raise ValueError(f"ranks_per_node={per_node!r} must be a positive rank count")
    sequence = config.sequence_parallel_size
    if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
        raise ValueError(f"sequence_parallel_size={sequence!r} must be a positive rank count (1: no sequence "
                         "parallelism)")
    if config.tag_validation not in ("Ignore", "Warn", "Fail"):
        raise ValueError(f"checkpoint.tag_validation={config.tag_validation!r} is not accepted; use Ignore, Warn or "
                         "Fail")
    experts = config.expert_parallel_size
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"expert_parallel.autoep_size={experts!r} is not an expert degree; use a positive divisor of "
                         "the data-parallel ranks and of each layer's experts (1: none)")
    degree = config.autotp_size
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 0:
        raise ValueError(f"tensor_parallel.autotp_size={degree!r} is not a tensor degree; use a positive divisor of "
                         "the ranks of a node (0 or 1: no tensor parallelism)")


def _check_tp_size(config: DeepSpeedConfig) -> None:
    """tensor_parallel.tp.tp_size beside tensor_parallel.autotp_size, as DeepSpeed 0.19.8 checks it (where the dict is
    read: no typed field holds it)."""
    degree, tp_size = config.get("tensor_parallel.autotp_size"), config.get("tensor_parallel.tp.tp_size")
    if tp_size not in (None, 1, degree):
        raise ValueError(f"tensor_parallel.tp.tp_size ({tp_size}) does not match tensor_parallel.autotp_size "
                         f"({degree}): give 1 or the same degree")


# ---------------------------------------------------------------------------------------------
# The start-up log's lines about the config
# ---------------------------------------------------------------------------------------------

def startup_log_lines(config: ZeroConfig) -> list[str]:
    """See ZeroConfig.startup_log_lines."""
    lines = [*config.notes, *(choice.line() for choice in config.auto_choices), *_meaning_lines(config)]
    if config.pending_auto:
        lines.append(f"still to resolve with the world size and the model: {', '.join(config.pending_auto)}")
    lines += default_differences(config.unset_defaults, DTYPE_NAMES[config.precision.param_dtype],
                                 DTYPE_NAMES[config.precision.reduce_dtype], config.stage)
    return lines


def _meaning_lines(config: ZeroConfig) -> list[str]:
    """Settings accepted with a meaning of zerokit's own, said once at start-up."""
    lines = []
    if config.stage == 3 and not config.overlap_comm:
        lines.append("zero_optimization.overlap_comm=false: stage 3 still reduces each unit during backward, "
                     "as it frees the unit's gradients (only when a reduction starts changes, never its sum)")
    if config.preemption.enabled:
        policy = config.preemption
        lines.append(f"preemption: {', '.join(policy.signals)} finish the step in flight, save a checkpoint in "
                     f"{policy.save_dir} and exit with code {policy.exit_code}")
    if config.sub_group_size == 0:
        lines.append("zero_optimization.sub_group_size=0: one optimizer piece per parameter, as DeepSpeed makes "
                     "every parameter its own sub-group")
    return lines


def _element_size(dtype: torch.dtype) -> int:
    return ELEMENT_BYTES[DTYPE_NAMES[dtype]]


# ---------------------------------------------------------------------------------------------
# DeepSpeed-style dicts, read by zerokit.config.dsconfig
# ---------------------------------------------------------------------------------------------

def _precision(config: DeepSpeedConfig) -> tuple[MixedPrecision, LossScaling | None]:
    name = compute_dtype(config)
    reduce_dtype = DTYPES_BY_NAME[config.get("communication_data_type") or "fp32"]
    scaling = None
    if name == "fp16":
        loss_scale = config.get("fp16.loss_scale")
        scaling = LossScaling(static_scale=loss_scale or None,
                              initial_scale_power=config.get("fp16.initial_scale_power"),
                              window=config.get("fp16.loss_scale_window"), hysteresis=config.get("fp16.hysteresis"),
                              min_scale=config.get("fp16.min_loss_scale"))
    return MixedPrecision(param_dtype=DTYPES_BY_NAME[name], reduce_dtype=reduce_dtype), scaling


def _bucket_bytes(config: DeepSpeedConfig, reduce_dtype: torch.dtype) -> int:
    elements, nbytes = config.get(Z + "reduce_bucket_size", None), config.get(Z + "reduce_bucket_bytes", None)
    if elements is not None and nbytes is not None:
        raise ValueError("give reduce_bucket_size (elements, DeepSpeed) or reduce_bucket_bytes, not both")
    if isinstance(elements, int):  # DeepSpeed counts elements, not bytes ("auto": resolved later, hidden^2)
        if elements <= 0:
            raise ValueError(f"zero_optimization.reduce_bucket_size={elements} must be > 0")
        return elements * _element_size(reduce_dtype)
    return DEFAULT_BUCKET_BYTES if nbytes is None else nbytes


FIELDS: dict[str, str] = {
    Z + "stage": "stage", TBS: "train_batch_size", MICRO: "train_micro_batch_size_per_gpu",
    GAS: "gradient_accumulation_steps", "gradient_clipping": "gradient_clipping",
    Z + "sub_group_size": "sub_group_size", Z + "reduce_scatter": "reduce_scatter", Z + "overlap_comm": "overlap_comm",
    Z + "reduce_every_micro_step": "reduce_every_micro_step", "max_consecutive_skipped_steps":
    "max_consecutive_skipped_steps", Z + "allgather_bucket_size": "allgather_bucket_size",
    Z + "allgather_partitions": "allgather_partitions", "zero_allow_untested_optimizer": "allow_untested_optimizer",
    "steps_per_print": "steps_per_print", "wall_clock_breakdown": "wall_clock_breakdown",
    "prescale_gradients": "prescale_gradients", "gradient_predivide_factor": "gradient_predivide_factor",
    "dataloader_drop_last": "dataloader_drop_last", "comm_timeout_seconds": "comm_timeout_seconds",
    "broadcast_buffers": "broadcast_buffers", Z + "mics_shard_size": "mics_shard_size",
    "ranks_per_node": "ranks_per_node", Z + "zero_hpz_partition_size": "hpz_partition_size",
    "tensor_parallel.autotp_size": "autotp_size", "checkpoint.tag_validation": "tag_validation",
    "sequence_parallel_size": "sequence_parallel_size",
    "checkpoint.async_save": "checkpoint_async_save",
    Z + "stage3_max_live_parameters": "stage3.max_live_parameters",
    Z + "stage3_prefetch_bucket_size": "stage3.prefetch_numel",
    Z + "stage3_param_persistence_threshold": "stage3.persistence_threshold",
    Z + "stage3_unit_classes": "stage3.unit_classes", Z + "stage3_min_unit_params": "stage3.min_unit_params",
}
"""The one table from DeepSpeed keys to the typed fields that hold their value as it is ("stage3.x": the Stage3Policy
field x). An absent key, or one still "auto", leaves the field's default, which is the key's default. Keys read into a
field of another shape are typed_fields' own: the precision blocks, reduce_bucket_size (elements, to bytes), the
accumulation dtype and the torch-free blocks (config/dsconfig/blocks.py)."""


HIDDEN_FIELDS = {HIDDEN_KEYS[0]: "reduce_bucket_bytes", HIDDEN_KEYS[1]: "stage3.prefetch_numel",
                 HIDDEN_KEYS[2]: "stage3.persistence_threshold"}
"""The typed fields that hold the hidden-size keys (reduce_bucket_size in bytes, not elements)."""


def _read_auto_value(name: str) -> Any:
    """What a hidden-size field holds when its key was read as "auto": its default, which the key shares."""
    if name.startswith("stage3."):
        owner, name = Stage3Policy, name.removeprefix("stage3.")
    else:
        owner = ZeroConfig
    return next(item.default for item in fields(owner) if item.name == name)


def typed_fields(config: DeepSpeedConfig) -> dict[str, Any]:
    """ZeroConfig's fields from a DeepSpeed config at the dict level, every "auto" in it resolved that can be (See
    [Note: resolving "auto"] in config/dsconfig/auto.py), and what is left to the world size and the model as values
    (`unknowns`, which resolve() fills in): from_dict builds the typed config with them, the one reading of the dict."""
    _check_tp_size(config)
    unknown = unknowns(config)
    given = {name: config.get(path) for path, name in FIELDS.items()
             if config.given(path) and config.get(path) is not AUTO}
    stage3 = {name.removeprefix("stage3."): given.pop(name) for name in list(given) if name.startswith("stage3.")}
    precision, scaling = _precision(config)
    data_types = config.get("data_types.grad_accum_dtype")
    return dict(**given, precision=precision, loss_scaling=scaling, stage3=Stage3Policy(**stage3),
                expert_parallel_size=config.get("expert_parallel.autoep_size") if config.get("expert_parallel.enabled")
                else 1,
                reduce_bucket_bytes=_bucket_bytes(config, precision.reduce_dtype),
                grad_accum_dtype=None if data_types is None else DTYPES_BY_NAME[data_types], **block_fields(config),
                pending_auto=unknown.pending, unknowns=unknown,
                unset_defaults=unset_differing_defaults(config), source=config)


def _field(config: Any, name: str) -> Any:
    """A typed field by its FIELDS name ("stage3.x" reaches into the Stage3Policy)."""
    for part in name.split("."):
        config = getattr(config, part)
    return config


def from_dict(raw: Mapping[str, Any]) -> ZeroConfig:
    """Build a ZeroConfig from DeepSpeed-style keys (see zerokit.config.dsconfig and docs/deepspeed_config.md)."""
    read_config = read(raw)
    resolution = resolve_auto(read_config)  # everything that needs neither the world size nor the model
    return ZeroConfig(**typed_fields(resolution.config), notes=read_config.notes, warnings=read_config.warnings,
                      auto_choices=resolution.choices)


def load_config(config: ZeroConfig | Mapping[str, Any] | str | Path | None) -> ZeroConfig:
    """Accept a ZeroConfig, a DeepSpeed-style dict, or the path of a JSON file."""
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, (str, Path)):
        return from_dict(read_json_object(config, "config file"))
    if isinstance(config, Mapping):
        return from_dict(config)
    raise ValueError(f"config must be a ZeroConfig, a dict or a JSON file path, not {type(config).__name__}")


__all__ = [           "ZeroConfig", "MixedPrecision", "LossScaling", "Stage3Policy", "Offload", "OptimizerSpec",
           "SchedulerSpec", "Preemption", "Resume", "ActivationCheckpointing", "CommsLogger", "FlopsProfiler",
           "Monitor", "Wandb", "load_config", "from_dict", "hidden_size_of", "replace"]
