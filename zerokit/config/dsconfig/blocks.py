"""Typed, validated blocks of a DeepSpeed config that need no torch: offload tiers, the optimizer and scheduler
blocks, activation checkpointing and observability. zerokit/config/typed.py holds them in ZeroConfig; each
field's default is DeepSpeed's (tests/test_dsconfig.py checks them against the schema).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import zerokit.config.dsconfig.values as v
from zerokit.config.dsconfig.keys import KeyClass
from zerokit.config.dsconfig.schema_optim import (OPTIMIZER_TYPES, REQUIRED_PARAMS, SCHEDULER_TYPES, canonical_type,
                                           params_table)
from zerokit._support.extras import installed, monitor_missing

DEVICES = ("none", "cpu", "nvme")
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def check_offload(device: str, nvme_path: str | None, ratio: float, counts: Mapping[str, int], where: str) -> None:
    """The rules of an offload block, named by `where` (e.g. "zero_optimization.offload_param")."""
    if device not in DEVICES:
        raise ValueError(f"{where}.device={device!r} is not accepted; use none, cpu or nvme")
    if device == "nvme" and not nvme_path:
        raise ValueError(f"{where}.device=nvme needs {where}.nvme_path, the NVMe mount to offload to")
    if not 0 < ratio <= 1:
        raise ValueError(f"{where}.ratio={ratio} must be in (0, 1]: the share of the optimizer step on the CPU")
    for name, count in counts.items():
        if count < 0:
            raise ValueError(f"{where}.{name}={count} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Where one kind of state lives: DeepSpeed's offload_optimizer or offload_param block."""

    device: str = "none"
    """none (accelerator memory), cpu (host memory) or nvme (files under nvme_path)."""
    pin_memory: bool = True
    """Page-locked host memory, for asynchronous copies."""
    nvme_path: str | None = None
    """The NVMe mount to offload to; needed with device nvme."""
    buffer_count: int = 4
    """Buffers in the NVMe swap pool (DeepSpeed: 4 for the optimizer, 5 for parameters)."""
    buffer_size: int = 100_000_000
    """offload_param only: elements per NVMe swap buffer."""
    max_in_cpu: int = 1_000_000_000
    """offload_param only: parameter elements kept in host memory with nvme."""
    ratio: float = 1.0
    """offload_optimizer only: share of the optimizer step done on the CPU, 0 < ratio <= 1."""
    fast_init: bool = False
    """offload_optimizer only: fast optimizer initialisation with nvme."""
    pipeline_read: bool = False
    """offload_optimizer only: overlap reading the next NVMe tile with the step."""
    pipeline_write: bool = False
    """offload_optimizer only: overlap writing the previous NVMe tile with the step."""

    def __post_init__(self) -> None:
        check_offload(self.device, self.nvme_path, self.ratio, {"buffer_count": self.buffer_count,
                      "buffer_size": self.buffer_size, "max_in_cpu": self.max_in_cpu}, "offload")

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def _params_tuple(kind: str, type_name: str, params: Any) -> tuple[tuple[str, Any], ...]:
    """Params as sorted (name, value) pairs (hashable, like the frozen config around them), each read as the
    schema reads it so that a typed block and a JSON block mean the same."""
    from zerokit.config.dsconfig.reader import coerce  # the reader imports this module's neighbours

    items = dict(params) if isinstance(params, Mapping) else dict(params or ())
    table = params_table(kind, type_name)
    out = []
    for name, value in sorted(items.items()):
        key = table.get(name)
        if key is None:
            guess = v.closest(name, table)
            hint = f"did you mean {guess}? " if guess else ""
            raise ValueError(f"{kind}.params.{name} is not a {type_name} parameter; {hint}accepted: "
                             f"{', '.join(sorted(table))}")
        value = coerce(key, value, f"{kind}.params.{name}")
        if value is v.AUTO:
            raise ValueError(f"{kind}.params.{name}='auto' must be resolved before the {kind} is built")
        if key.accepts and value not in key.accepts and key.klass in (KeyClass.ALWAYS, KeyClass.REFUSED):
            raise ValueError(f"{kind}.params.{name}={v.show(value)} is not supported: {key.why}")
        out.append((name, value))
    return tuple(out)


def _canonical_block(block: Any, kind: str, types: Sequence[str]) -> str:
    """An optimizer or scheduler block's type in its canonical spelling, and its params checked, set on the (frozen)
    block; returns the type."""
    name = canonical_type(kind, str(block.type))
    if name not in types:
        raise ValueError(f"{kind}.type={block.type!r} is not one zerokit builds; use {v.words(types)}")
    object.__setattr__(block, "type", name)
    object.__setattr__(block, "params", _params_tuple(kind, name, block.params))
    return name


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """An `optimizer` block: built by zerokit.engine.schedules.build_optimizer when initialize() gets no optimizer."""

    type: str
    """Adam, AdamW, SGD, Adagrad or Muon."""
    params: tuple[tuple[str, Any], ...] = ()
    """The hyperparameters given (a dict is accepted); DeepSpeed's defaults fill in the rest."""

    def __post_init__(self) -> None:
        _canonical_block(self, "optimizer", OPTIMIZER_TYPES)

    def value(self, name: str) -> Any:
        """The given value, else DeepSpeed's default for this type."""
        return dict(self.params).get(name, params_table("optimizer", self.type)[name].default)

    @property
    def adam_w_mode(self) -> bool:
        """Decoupled weight decay: always for AdamW, DeepSpeed's adam_w_mode (default true) for Adam and Muon."""
        return self.type == "AdamW" or (self.type in ("Adam", "Muon") and bool(self.value("adam_w_mode")))


@dataclass(frozen=True, kw_only=True)
class SchedulerSpec:
    """A `scheduler` block: built by zerokit.engine.schedules.build_scheduler, stepped at each optimizer step."""

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest."""
    params: tuple[tuple[str, Any], ...] = ()
    """The parameters given (a dict is accepted); DeepSpeed's defaults fill in the rest."""

    def __post_init__(self) -> None:
        name = _canonical_block(self, "scheduler", SCHEDULER_TYPES)
        for required in REQUIRED_PARAMS.get(name, ()):
            if required not in dict(self.params):
                raise ValueError(f"scheduler.params.{required} is required by {name}")

    def value(self, name: str) -> Any:
        return dict(self.params).get(name, params_table("scheduler", self.type)[name].default)

    def kwargs(self) -> dict[str, Any]:
        """Every parameter of the schedule, given or default."""
        return {name: self.value(name) for name in params_table("scheduler", self.type)}


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointing:
    """DeepSpeed's activation_checkpointing block (for checkpointed modules)."""

    partition_activations: bool = False
    """Partition checkpoints over model-parallel ranks (no model parallelism here: a no-op)."""
    cpu_checkpointing: bool = False
    """Keep checkpointed activations in host memory."""
    contiguous_memory_optimization: bool = False
    """Copy partitioned checkpoints into one buffer."""
    number_checkpoints: int | None = None
    """Checkpoints per step, to size that buffer."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at each checkpoint boundary."""
    profile: bool = False
    """Log forward/backward time of each checkpointed function."""
    checkpoint_units: bool = False
    """zerokit's own, stage 3: checkpoint every unit's forward (See zerokit/engine/activations.py)."""

    def __post_init__(self) -> None:
        if self.number_checkpoints is not None and self.number_checkpoints < 1:
            raise ValueError(f"activation_checkpointing.number_checkpoints={self.number_checkpoints} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class CommsLogger:
    """DeepSpeed's comms_logger block: zerokit logs comm_stats() per step."""

    enabled: bool = False
    verbose: bool = False
    """Log every collective as it is issued."""
    prof_all: bool = True
    """Every collective kind; false: only prof_ops."""
    debug: bool = False
    """Name the caller of each collective."""
    prof_ops: tuple[str, ...] = ()
    """Collective kinds to log when prof_all is false."""


@dataclass(frozen=True, kw_only=True)
class FlopsProfiler:
    """DeepSpeed's flops_profiler block: model FLOPs at one step (torch.utils.flop_counter)."""

    enabled: bool = False
    profile_step: int = 1
    """The optimizer step to profile."""
    module_depth: int = -1
    """Module depth to aggregate at; -1: every depth."""
    top_modules: int = 1
    """How many of the costliest modules to report."""
    detailed: bool = True
    """Report per module."""
    output_file: str | None = None
    """Write the report here; None: the log."""
    recompute_fwd_factor: float = 0.0
    """Extra forward share recomputed by activation checkpointing."""

    def __post_init__(self) -> None:
        if self.profile_step < 1:
            raise ValueError(f"flops_profiler.profile_step={self.profile_step} must be >= 1")
        if self.top_modules < 1 or self.module_depth < -1:
            raise ValueError("flops_profiler.top_modules must be >= 1 and module_depth >= -1")


def _signal_name(value: Any) -> str:
    """SIGTERM from "SIGTERM", "sigterm", "TERM" or signal.SIGTERM; refused in one line if not a signal a handler
    can catch."""
    name = value.name if isinstance(value, signal.Signals) else str(value).upper()
    name = name if name.startswith("SIG") else "SIG" + name
    if name not in signal.Signals.__members__ or name in UNCATCHABLE:
        raise ValueError(f"preemption.signals: {value!r} is not a signal a process can catch; use names such as "
                         "SIGTERM (torchrun, Kubernetes, SLURM at the end of a job), SIGUSR1 (SLURM's --signal) or "
                         "SIGINT")
    return name


@dataclass(frozen=True, kw_only=True)
class Preemption:
    """zerokit's `preemption` block: on one of `signals`, finish the step in flight, save a checkpoint in save_dir
    and exit with exit_code, which a scheduler can read as "requeue" (See [Note: preemption] in
    zerokit/reliability/preemption.py)."""

    enabled: bool = False
    save_dir: str | None = None
    """Where the preemption checkpoint goes (tag global_step<N>, `latest` pointed at it); needed when enabled."""
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """What torchrun, Kubernetes and SLURM send before they kill (SIGTERM), and what SLURM's --signal and
    Lightning's SLURM requeue use (SIGUSR1)."""
    exit_code: int = 75
    """sysexits.h's EX_TEMPFAIL, "try again later": not 0 (done: nothing requeues, torchrun restarts nothing), not 1
    (a crash), not 128+N (killed by signal N). torchrun restarts on any code other than 0."""

    def __post_init__(self) -> None:
        names = (self.signals,) if isinstance(self.signals, (str, signal.Signals)) else tuple(self.signals)
        object.__setattr__(self, "signals", tuple(dict.fromkeys(_signal_name(name) for name in names)))
        if self.enabled and not self.save_dir:
            raise ValueError("preemption.enabled needs preemption.save_dir, the directory the preemption "
                             "checkpoint is saved in (and the job resumes from)")
        if self.enabled and not self.signals:
            raise ValueError("preemption.signals is empty; name the signals that preempt, e.g. [\"SIGTERM\", "
                             "\"SIGUSR1\"]")
        code = self.exit_code
        if isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 125:
            raise ValueError(f"preemption.exit_code={code!r} must be 1-125: 0 reads as a finished job (nothing is "
                             "requeued or restarted), 126-255 as a command not run or killed by a signal")


@dataclass(frozen=True, kw_only=True)
class Resume:
    """zerokit's `resume` block: at initialize, load the newest complete checkpoint in load_dir and the data position
    saved with it, or start fresh when there is none (See [Note: the newest complete checkpoint] in
    zerokit/checkpoint/newest.py)."""

    load_dir: str | None = None
    """The directory checkpoints are saved in; None: no resume at start-up."""

    def __post_init__(self) -> None:
        if self.load_dir is not None and (not isinstance(self.load_dir, str) or not self.load_dir):
            raise ValueError(f"resume.load_dir={self.load_dir!r} must be the directory checkpoints are saved in (a "
                             "non-empty string), or null for no resume at start-up")


def _require_package(package: str, key: str) -> None:
    if not installed(package):
        raise ValueError(monitor_missing(package, key))


@dataclass(frozen=True, kw_only=True)
class Monitor:
    """DeepSpeed's tensorboard or csv_monitor block: training metrics written under output_path/job_name."""

    enabled: bool = False
    output_path: str = ""
    """Directory; empty: the working directory."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory for this run."""


@dataclass(frozen=True, kw_only=True)
class Wandb:
    """DeepSpeed's wandb block."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"

    def __post_init__(self) -> None:
        if self.enabled:
            _require_package("wandb", "wandb")


def tensorboard_available() -> None:
    """torch.utils.tensorboard needs the tensorboard package; say so at start, not at the first log."""
    _require_package("tensorboard", "tensorboard")


def from_values(cls: type, given: Mapping[str, Any]) -> Any:
    """A block dataclass from the keys given under its section (the rest keep their defaults)."""
    names = {f.name for f in fields(cls)}
    return cls(**{name: (tuple(value) if isinstance(value, list) else value)
                  for name, value in given.items() if name in names})


def offload_from(given: Mapping[str, Any], where: str, buffer_count: int) -> Offload:
    """An Offload from the keys given under `where`, checked with their full names first."""
    check_offload(given.get("device", "none"), given.get("nvme_path"), given.get("ratio", 1.0),
                  {name: given[name] for name in ("buffer_count", "buffer_size", "max_in_cpu") if name in given},
                  where)
    return from_values(Offload, {"buffer_count": buffer_count, **given})


def block_fields(config: Any) -> dict[str, Any]:
    """ZeroConfig's torch-free block fields from a read DeepSpeedConfig (no AUTO left in these blocks)."""
    z = "zero_optimization."
    out: dict[str, Any] = {
        "offload_optimizer": offload_from(config.under(z + "offload_optimizer"), z + "offload_optimizer", 4),
        "offload_param": offload_from(config.under(z + "offload_param"), z + "offload_param", 5),
        "activation_checkpointing": from_values(ActivationCheckpointing, config.under("activation_checkpointing")),
        "comms_logger": from_values(CommsLogger, config.under("comms_logger")),
        "flops_profiler": from_values(FlopsProfiler, config.under("flops_profiler")),
        "csv_monitor": from_values(Monitor, config.under("csv_monitor")),
        "tensorboard": from_values(Monitor, config.under("tensorboard")),
        "wandb": from_values(Wandb, config.under("wandb")),
        "preemption": from_values(Preemption, config.under("preemption")),
        "resume": from_values(Resume, config.under("resume")),
    }
    for kind, spec in (("optimizer", OptimizerSpec), ("scheduler", SchedulerSpec)):
        if config.given(kind + ".type"):
            out[kind] = spec(type=config.get(kind + ".type"), params=config.under(kind + ".params"))
    return out
