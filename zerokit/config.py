"""Typed, validated configuration, readable from DeepSpeed-style JSON.

A config can be given three ways and always ends up as one frozen `ZeroConfig`: a `ZeroConfig` object, a dict
with DeepSpeed's keys, or the path of a JSON file holding that dict. Dicts are read by zerokit.dsconfig, the
one place DeepSpeed's keys are known (the planner's translator reads them there too): every key of
DeepSpeed's schema is honoured, accepted because zerokit always does that (named in the start-up log), or
refused in one line naming the key, what it asks for and why zerokit does not offer it. A misspelt key is
refused with the closest accepted one, because a silently ignored knob is how a run trains wrong without
anyone noticing.

"auto" values (Hugging Face templates) that need the world size or the model stay pending until
`ZeroConfig.resolve(world_size=, hidden_size=)`; `startup_log_lines()` then says what zerokit chose.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from zerokit.defaults import DEFAULT_BUCKET_BYTES
from zerokit.dsconfig import AUTO, DeepSpeedConfig, read
from zerokit.dsconfig.auto import (GAS, MICRO, TBS, Choice, default_differences, derive_batch, hidden_size_of,
                                   pending)
from zerokit.dsconfig.auto import resolve as resolve_auto
from zerokit.dsconfig.blocks import (ActivationCheckpointing, CommsLogger, FlopsProfiler, Monitor, Offload,
                                     OptimizerSpec, SchedulerSpec, Wandb, block_fields, tensorboard_available)
from zerokit.dsconfig.precision import compute_dtype
from zerokit.jsonfile import read_json_object
from zerokit.settings import ELEMENT_BYTES, EngineSettings

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
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    window: int = 1000
    """Steps without overflow before the scale doubles (DeepSpeed `loss_scale_window`)."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved (the step is skipped either way)."""
    min_scale: float = 1.0
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
    min_unit_params: int = 100_000
    """Auto-wrap only: the fewest parameters a ModuleList/Sequential member needs to become a unit."""
    max_live_parameters: int = 1_000_000_000
    """Never hold more than this many unsharded parameter elements at once (DeepSpeed
    stage3_max_live_parameters); prefetches that would exceed it wait."""
    prefetch_numel: int = 50_000_000
    """Gather the next units ahead of use while their total stays under this (stage3_prefetch_bucket_size)."""
    persistence_threshold: int = 100_000
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
            raise ValueError(f"stage3 skipped_units={self.skipped_units!r} is not a policy; use \"raise\" or \"gather\"")
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

    stage: int = 0
    """0: plain data parallel; 1: shard optimizer state; 2: also gradients; 3: also parameters."""
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    loss_scaling: LossScaling | None = None
    """Set (and only set) when param_dtype is fp16."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step; the loss is divided by this in `engine.backward`."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm (across all shards) to this value; 0 disables clipping."""
    reduce_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Gradients are reduced in buckets of about this many bytes (in reduce_dtype)."""
    sub_group_size: int | None = None
    """The optimizer steps each fp32 master in pieces of at most this many elements (DeepSpeed's
    sub_group_size). None: 65536 on the CPU, whole parameters on a GPU; 0: whole parameters everywhere, as
    DeepSpeed's 0 makes every parameter its own sub-group. See [Note: optimizer pieces]."""
    reduce_scatter: bool | None = None
    """Stages 1-3: True reduce-scatters each gradient bucket; False all-reduces it and keeps this rank's
    shard (DeepSpeed's reduce_scatter key). None: reduce-scatter, except on gloo, whose reduce-scatter
    is slower than its all-reduce. See [Note: reducing a bucket to a shard]."""
    overlap_comm: bool = True
    """Stages 0-2: launch each bucket's reduction during backward as soon as it is full (false: after backward).
    Stage 3 always reduces each unit during backward, as it frees the unit's gradients; false is accepted and
    logged there, as it changes only when a reduction starts, never what it sums."""
    reduce_every_micro_step: bool = True
    """Stage 2 only. True: reduce-scatter on every micro-step, so a rank never holds more than its
    gradient shard plus in-flight buckets (the ZeRO-2 memory promise; costs one reduce-scatter per
    micro-step). False: accumulate full gradients locally and reduce once per optimizer step (stage-1
    gradient memory during accumulation; one reduce-scatter per step)."""
    stage3: Stage3Policy = field(default_factory=Stage3Policy)
    max_consecutive_skipped_steps: int = 20
    """Training raises after this many optimizer steps in a row were skipped for inf/nan gradients."""
    train_batch_size: int | None = None
    """Optional check: must equal micro batch x accumulation steps x world size."""
    train_micro_batch_size_per_gpu: int | None = None
    offload_optimizer: Offload = field(default_factory=Offload)
    """Where fp32 masters, their gradients and optimizer state live (stages 1-3)."""
    offload_param: Offload = field(default_factory=lambda: Offload(buffer_count=5))
    """Where sharded parameters live between uses (stage 3 only)."""
    allgather_bucket_size: int = 500_000_000
    """DeepSpeed's all-gather staging size, read and checked only: zerokit gathers each bucket's updated
    parameters in place into the flat buffer, so there is no staging buffer for it to bound."""
    allgather_partitions: bool = True
    """DeepSpeed's choice of all-gather (true) or broadcasts (false) for updated parameters, read and logged
    only: zerokit picks the gather per back-end, and either way every rank ends with the same values."""
    allow_untested_optimizer: bool = False
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
    steps_per_print: int | None = None
    """Log loss, LR, grad norm, loss scale, skips and step time every this many optimizer steps."""
    wall_clock_breakdown: bool = False
    """Time forward, backward, reduction and optimizer step."""
    comms_logger: CommsLogger = field(default_factory=CommsLogger)
    flops_profiler: FlopsProfiler = field(default_factory=FlopsProfiler)
    csv_monitor: Monitor = field(default_factory=Monitor)
    tensorboard: Monitor = field(default_factory=Monitor)
    wandb: Wandb = field(default_factory=Wandb)
    prescale_gradients: bool = False
    """Divide gradients by the world size before the reduction instead of after (DeepSpeed's meaning)."""
    gradient_predivide_factor: float = 1.0
    """With prescale_gradients False: divide by this before the reduction and by world size / this after."""
    grad_accum_dtype: torch.dtype | None = None
    """dtype gradients accumulate in across micro-steps (data_types.grad_accum_dtype); None: as today."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of a loader built from training_data."""
    comm_timeout_seconds: float = 300.0
    """Every collective's deadline; a collective still waiting after this raises."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's module buffers to every rank, as torch DDP does."""
    mics_shard_size: int = -1
    """Stages 1-3: shard over groups of this many consecutive ranks, replicated across the groups (DeepSpeed's MiCS,
    FSDP's HSDP; See [Note: hybrid sharding] in comm/groups.py); -1: one group over every rank."""
    hpz_partition_size: int = 1
    """Stage 3: ZeRO++ hpZ, a secondary copy of the parameter shards split over groups of this many consecutive
    ranks, which every gather after the first of a step reads (See [Note: hpZ's secondary copy] in
    flat/sharded.py); 1: none."""
    ranks_per_node: int | None = None
    """Ranks on each node, numbered consecutively. None: torchrun's LOCAL_WORLD_SIZE, else one node (the start-up
    fingerprint checks that every rank agrees on the outcome)."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """Start-up log lines from reading the config: keys accepted because zerokit always does that, aliases."""
    warnings: tuple[str, ...] = field(default=(), compare=False)
    """Start-up warnings from reading the config: keys ignored, as DeepSpeed ignores them."""
    auto_choices: tuple[Choice, ...] = field(default=(), compare=False)
    """What "auto" (and absent batch keys) resolved to."""
    pending_auto: tuple[str, ...] = field(default=(), compare=False)
    """Keys whose value needs the world size or the model: see resolve()."""
    source: DeepSpeedConfig | None = field(default=None, compare=False, repr=False)
    """The DeepSpeed config this was read from (None for a typed config)."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage={self.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={self.gradient_accumulation_steps} must be >= 1")
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping={self.gradient_clipping} must be >= 0 (0 disables clipping)")
        if self.reduce_bucket_bytes < 1:
            raise ValueError(f"reduce_bucket_bytes={self.reduce_bucket_bytes} must be a positive byte count")
        if self.sub_group_size is not None and self.sub_group_size < 0:
            raise ValueError(f"zero_optimization.sub_group_size={self.sub_group_size} must be an element count >= 0 "
                             "(0: one optimizer piece per parameter)")
        if self.max_consecutive_skipped_steps < 1:
            raise ValueError("max_consecutive_skipped_steps must be >= 1")
        is_fp16 = self.precision.param_dtype == torch.float16
        if is_fp16 and self.loss_scaling is None:
            object.__setattr__(self, "loss_scaling", LossScaling())
        if not is_fp16 and self.loss_scaling is not None:
            raise ValueError("loss scaling is only for fp16; bf16 and fp32 gradients do not underflow that way")
        if not self.reduce_every_micro_step and self.stage != 2:
            raise ValueError("reduce_every_micro_step=False is a stage-2 choice; stages 0-1 never reduce "
                             "before the accumulation boundary and stage 3 always reduces every micro-step")
        self._check_offload()
        self._check_new_fields()

    def _check_offload(self) -> None:
        if self.offload_param.enabled and self.stage != 3:
            raise ValueError(f"zero_optimization.offload_param.device={self.offload_param.device} needs stage 3 "
                             f"(only stage 3 shards parameters); zero_optimization.stage={self.stage}")
        optimizer = self.offload_optimizer
        # DeepSpeed offers NVMe and Twin-Flow (ratio) at stage 3 only; zerokit's tiers serve stages 1-3 alike
        if optimizer.enabled and self.stage == 0:
            raise ValueError(f"zero_optimization.offload_optimizer.device={optimizer.device} needs stage 1, 2 or 3, "
                             "which shard the optimizer state it moves")

    def _check_new_fields(self) -> None:
        if self.allgather_bucket_size < 1:
            raise ValueError(f"zero_optimization.allgather_bucket_size={self.allgather_bucket_size} must be > 0")
        if self.steps_per_print is not None and self.steps_per_print < 1:
            raise ValueError(f"steps_per_print={self.steps_per_print} must be >= 1")
        if not self.gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor={self.gradient_predivide_factor} must be > 0")
        if not (math.isfinite(self.comm_timeout_seconds) and self.comm_timeout_seconds > 0):
            raise ValueError(f"comm_timeout_seconds={self.comm_timeout_seconds} must be a positive number of seconds")
        if isinstance(self.mics_shard_size, bool) or not (self.mics_shard_size == -1 or self.mics_shard_size >= 1):
            raise ValueError(f"zero_optimization.mics_shard_size={self.mics_shard_size!r} is not a shard group size; "
                             "use a positive divisor of the world size, or -1 for one group over every rank")
        if self.mics_shard_size != -1 and self.stage == 0:
            raise ValueError(f"zero_optimization.mics_shard_size={self.mics_shard_size} needs stage 1, 2 or 3 (stage 0 "
                             "shards nothing); zero_optimization.stage=0")
        if isinstance(self.hpz_partition_size, bool) or self.hpz_partition_size < 1:
            raise ValueError(f"zero_optimization.zero_hpz_partition_size={self.hpz_partition_size!r} is not a group "
                             "size; use a positive divisor of the world size, or 1 for no secondary copy")
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool) or self.ranks_per_node < 1):
            raise ValueError(f"ranks_per_node={self.ranks_per_node!r} must be a positive rank count")
        if self.grad_accum_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"data_types.grad_accum_dtype={self.grad_accum_dtype} is not supported; use fp32, bf16 "
                             "or fp16")
        if self.tensorboard.enabled:
            tensorboard_available()

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
        chosen. It fills in what the DeepSpeed dict left "auto" or absent (replace() such fields after
        resolving). A typed config has nothing to fill in and is only checked."""
        if self.source is None:
            self.check_batch_sizes(world_size)
            return self
        # Batch sizes the dict gave are taken from the typed fields, which replace() may have changed since.
        given = {path: getattr(self, name) for path, name in RESOLVED_FIELDS.items()
                 if self.source.given(path) and self.source.get(path) is not AUTO}
        resolution = resolve_auto(self.source.with_values(given), world_size=world_size, hidden_size=hidden_size)
        # The batch sizes are always filled in (all unknown: micro-batch 1, accumulation 1), for the engine's
        # train_batch_size() and train_micro_batch_size_per_gpu().
        updates: dict[str, Any] = {name: resolution.config.get(path) for path, name in RESOLVED_FIELDS.items()}
        stage3: dict[str, int] = {}
        for choice in resolution.choices:
            if choice.path == Z + "reduce_bucket_size":
                updates["reduce_bucket_bytes"] = choice.value * _element_size(self.precision.reduce_dtype)
            elif choice.path in STAGE3_FIELDS:
                stage3[STAGE3_FIELDS[choice.path]] = choice.value
        resolved = replace(self, **updates, stage3=replace(self.stage3, **stage3), pending_auto=(),
                           auto_choices=self.auto_choices + resolution.choices, source=resolution.config)
        resolved.check_batch_sizes(world_size)
        return resolved

    def startup_log_lines(self) -> list[str]:
        """What the start-up log should say about the config: keys accepted because zerokit always does that,
        aliases read as their key, what "auto" resolved to, and zerokit defaults that differ from DeepSpeed's."""
        lines = [*self.notes, *(choice.line() for choice in self.auto_choices), *self._meaning_lines()]
        if self.pending_auto:
            lines.append(f"still to resolve with the world size and the model: {', '.join(self.pending_auto)}")
        if self.source is not None:
            lines += default_differences(self.source, _dtype_name(self.precision.param_dtype),
                                         _dtype_name(self.precision.reduce_dtype), self.stage)
        return lines

    def _meaning_lines(self) -> list[str]:
        """Settings accepted with a meaning of zerokit's own, said once at start-up."""
        lines = []
        if self.stage == 3 and not self.overlap_comm:
            lines.append("zero_optimization.overlap_comm=false: stage 3 still reduces each unit during backward, "
                         "as it frees the unit's gradients (only when a reduction starts changes, never its sum)")
        if self.sub_group_size == 0:
            lines.append("zero_optimization.sub_group_size=0: one optimizer piece per parameter, as DeepSpeed makes "
                         "every parameter its own sub-group")
        return lines


RESOLVED_FIELDS = {TBS: "train_batch_size", MICRO: "train_micro_batch_size_per_gpu",
                   GAS: "gradient_accumulation_steps"}
STAGE3_FIELDS = {Z + "stage3_max_live_parameters": "max_live_parameters",
                 Z + "stage3_prefetch_bucket_size": "prefetch_numel",
                 Z + "stage3_param_persistence_threshold": "persistence_threshold",
                 Z + "stage3_unit_classes": "unit_classes", Z + "stage3_min_unit_params": "min_unit_params"}
SCALAR_FIELDS = {
    **RESOLVED_FIELDS, "gradient_clipping": "gradient_clipping", Z + "sub_group_size": "sub_group_size",
    Z + "reduce_scatter": "reduce_scatter", Z + "overlap_comm": "overlap_comm",
    Z + "reduce_every_micro_step": "reduce_every_micro_step", "max_consecutive_skipped_steps":
    "max_consecutive_skipped_steps", Z + "allgather_bucket_size": "allgather_bucket_size",
    Z + "allgather_partitions": "allgather_partitions", "zero_allow_untested_optimizer": "allow_untested_optimizer",
    "steps_per_print": "steps_per_print", "wall_clock_breakdown": "wall_clock_breakdown",
    "prescale_gradients": "prescale_gradients", "gradient_predivide_factor": "gradient_predivide_factor",
    "dataloader_drop_last": "dataloader_drop_last", "comm_timeout_seconds": "comm_timeout_seconds",
    "broadcast_buffers": "broadcast_buffers", Z + "mics_shard_size": "mics_shard_size",
    "ranks_per_node": "ranks_per_node", Z + "zero_hpz_partition_size": "hpz_partition_size",
}


def engine_settings(config: ZeroConfig, world_size: int, backend: str) -> EngineSettings:
    """What an engine with this (resolved) config does on these ranks and back-end, decided once (See [Note: one place for
    each engine decision] in settings.py)."""
    return EngineSettings.resolve(stage=config.stage, world_size=world_size, backend=backend,
                                  reduce_scatter=config.reduce_scatter,
                                  reduce_every_micro_step=config.reduce_every_micro_step,
                                  bucket_bytes=config.reduce_bucket_bytes,
                                  reduce_dtype=DTYPE_NAMES[config.precision.reduce_dtype],
                                  mics_shard_size=config.mics_shard_size, hpz_partition_size=config.hpz_partition_size,
                                  ranks_per_node=config.ranks_per_node or ranks_per_node_from_launcher(world_size))


def ranks_per_node_from_launcher(world_size: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE where it set one that divides the world size; else every rank on one node."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1 or world_size % int(local):
        return world_size
    return int(local)


def _element_size(dtype: torch.dtype) -> int:
    return ELEMENT_BYTES[DTYPE_NAMES[dtype]]


def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


# ---------------------------------------------------------------------------------------------
# DeepSpeed-style dicts, read by zerokit.dsconfig
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


def _given(config: DeepSpeedConfig, table: Mapping[str, str]) -> dict[str, Any]:
    """The typed fields a table maps from the keys given (AUTO ones wait for resolve())."""
    return {name: config.get(path) for path, name in table.items()
            if config.given(path) and config.get(path) is not AUTO}


def from_dict(raw: Mapping[str, Any]) -> ZeroConfig:
    """Build a ZeroConfig from DeepSpeed-style keys (see zerokit.dsconfig and docs/deepspeed_config.md)."""
    read_config = read(raw)
    resolution = resolve_auto(read_config)  # everything that needs neither the world size nor the model
    config = resolution.config
    precision, scaling = _precision(config)
    data_types = config.get("data_types.grad_accum_dtype")
    return ZeroConfig(
        stage=config.get(Z + "stage"), precision=precision, loss_scaling=scaling,
        reduce_bucket_bytes=_bucket_bytes(config, precision.reduce_dtype),
        stage3=Stage3Policy(**_given(config, STAGE3_FIELDS)),
        grad_accum_dtype=None if data_types is None else DTYPES_BY_NAME[data_types],
        **_given(config, SCALAR_FIELDS), **block_fields(config),
        notes=read_config.notes, warnings=read_config.warnings, auto_choices=resolution.choices,
        pending_auto=pending(config), source=config,
    )


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


__all__ = ["engine_settings", "ZeroConfig", "MixedPrecision", "LossScaling", "Stage3Policy", "Offload", "OptimizerSpec",
           "SchedulerSpec", "ActivationCheckpointing", "CommsLogger", "FlopsProfiler", "Monitor", "Wandb",
           "load_config", "from_dict", "hidden_size_of", "replace"]
