"""Typed, validated configuration, readable from DeepSpeed-style JSON.

A config can be given three ways and always ends up as one frozen `ZeroConfig`:
a `ZeroConfig` object, a dict with DeepSpeed's keys, or the path of a JSON file holding that dict.
Unknown keys and contradictory settings raise `ValueError` with one line that names the key and
what is accepted, because a silently ignored knob is how a run trains wrong without anyone noticing.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from zerokit.defaults import DEFAULT_BUCKET_BYTES

DTYPES_BY_NAME = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


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

    def __post_init__(self) -> None:
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
    sub_group_size). None: 65536 on the CPU, whole masters on a GPU. See [Note: optimizer pieces]."""
    reduce_scatter: bool | None = None
    """Stages 1-3: True reduce-scatters each gradient bucket; False all-reduces it and keeps this rank's
    shard (DeepSpeed's reduce_scatter key). None: reduce-scatter, except on gloo, whose reduce-scatter
    is slower than its all-reduce. See [Note: reducing a bucket to a shard]."""
    overlap_comm: bool = True
    """Launch each bucket's reduction during backward as soon as it is full."""
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

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage={self.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={self.gradient_accumulation_steps} must be >= 1")
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping={self.gradient_clipping} must be >= 0 (0 disables clipping)")
        if self.reduce_bucket_bytes < 1:
            raise ValueError(f"reduce_bucket_bytes={self.reduce_bucket_bytes} must be a positive byte count")
        if self.sub_group_size is not None and self.sub_group_size < 1:
            raise ValueError(f"zero_optimization.sub_group_size={self.sub_group_size} must be a positive element count")
        if self.max_consecutive_skipped_steps < 1:
            raise ValueError("max_consecutive_skipped_steps must be >= 1")
        is_fp16 = self.precision.param_dtype == torch.float16
        if is_fp16 and self.loss_scaling is None:
            object.__setattr__(self, "loss_scaling", LossScaling())
        if not is_fp16 and self.loss_scaling is not None:
            raise ValueError("loss scaling is only for fp16; bf16 and fp32 gradients do not underflow that way")
        if self.stage == 3 and not self.overlap_comm:
            raise ValueError("overlap_comm=false is not supported at stage 3, which reduces each unit in backward")
        if not self.reduce_every_micro_step and self.stage != 2:
            raise ValueError("reduce_every_micro_step=False is a stage-2 choice; stages 0-1 never reduce "
                             "before the accumulation boundary and stage 3 always reduces every micro-step")

    @property
    def is_fp16(self) -> bool:
        return self.precision.param_dtype == torch.float16

    def check_batch_sizes(self, world_size: int) -> None:
        """DeepSpeed's batch identity, checked once the world size is known."""
        micro, total = self.train_micro_batch_size_per_gpu, self.train_batch_size
        if micro is None or total is None:
            return
        expected = micro * self.gradient_accumulation_steps * world_size
        if total != expected:
            raise ValueError(
                f"train_batch_size={total} but train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                f"world size = {micro} x {self.gradient_accumulation_steps} x {world_size} = {expected}")


# ---------------------------------------------------------------------------------------------
# DeepSpeed-style dicts
# ---------------------------------------------------------------------------------------------

TOP_LEVEL_KEYS = {
    "zero_optimization", "bf16", "fp16", "gradient_accumulation_steps", "gradient_clipping",
    "communication_data_type", "train_batch_size", "train_micro_batch_size_per_gpu",
    "max_consecutive_skipped_steps",
}
# DeepSpeed spells the stage-3 keys with or without the stage3_ prefix.
STAGE3_KEYS = {
    "max_live_parameters": "max_live_parameters", "stage3_max_live_parameters": "max_live_parameters",
    "prefetch_bucket_size": "prefetch_numel", "stage3_prefetch_bucket_size": "prefetch_numel",
    "param_persistence_threshold": "persistence_threshold",
    "stage3_param_persistence_threshold": "persistence_threshold",
    "stage3_unit_classes": "unit_classes", "stage3_min_unit_params": "min_unit_params",
}
ZERO_KEYS = {
    "stage", "reduce_bucket_size", "reduce_bucket_bytes", "overlap_comm", "contiguous_gradients",
    "reduce_scatter", "reduce_every_micro_step", "sub_group_size", *STAGE3_KEYS,
}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}
BF16_KEYS = {"enabled"}
# Keys a DeepSpeed user may carry over that mean something zerokit does differently.
EXPLAINED_REJECTIONS = {
    "optimizer": "zerokit wraps the torch optimizer you pass to initialize(); remove the 'optimizer' block",
    "scheduler": "attach a torch LR scheduler to engine.optimizer; remove the 'scheduler' block",
    "allgather_bucket_size": "zerokit all-gathers parameters in the reduce buckets; set reduce_bucket_size",
}


def _reject_unknown(section: str, given: Mapping[str, Any], accepted: set[str]) -> None:
    for key in given:
        if key in EXPLAINED_REJECTIONS:
            raise ValueError(f"{section}{key} is not supported: {EXPLAINED_REJECTIONS[key]}")
        if key not in accepted:
            raise ValueError(f"unknown config key {section}{key!r}; accepted: {', '.join(sorted(accepted))}")


# [Note: reading JSON values strictly]
# Python's bool("false") is True and int(2.7) is 2, so coercing would turn a quoted or mistyped value into a
# different setting without a word. Each value is read by one helper below that accepts only what the key
# means: real JSON booleans, whole numbers (JSON has one number type, so DeepSpeed's 5e8 arrives as a float
# and is accepted when it is whole), finite floats. bool is an int subclass in Python but never a number here.

def _auto_hint(raw: Any) -> str:
    # DeepSpeed configs copied from Hugging Face examples carry "auto", which only the HF Trainer fills in.
    if isinstance(raw, str) and raw == "auto":
        return " (\"auto\" is a Hugging Face Trainer placeholder; write the value)"
    return ""


def _bool(raw: Any, key: str) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"{key}={raw!r} is not a boolean; use true or false{_auto_hint(raw)}")
    return raw


def _int(raw: Any, key: str) -> int:
    if isinstance(raw, numbers.Integral) and not isinstance(raw, bool):
        return int(raw)
    if isinstance(raw, numbers.Real) and not isinstance(raw, bool):
        if math.isfinite(raw) and float(raw).is_integer():
            return int(raw)
        raise ValueError(f"{key}={raw!r} must be a whole number")
    raise ValueError(f"{key}={raw!r} is not a number; zerokit needs a whole number here{_auto_hint(raw)}")


def _finite(raw: Any, key: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real):
        raise ValueError(f"{key}={raw!r} is not a number; zerokit needs a number here{_auto_hint(raw)}")
    if not math.isfinite(raw):  # json.loads reads NaN and Infinity; a nan clip value would disable clipping
        raise ValueError(f"{key}={raw!r} must be a finite number")
    return float(raw)


def _section(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a JSON object, not {value!r}")
    return dict(value)


def _dtype(name: Any, key: str) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES_BY_NAME:
        raise ValueError(f"{key}={name!r} is not a dtype zerokit knows; use fp32, bf16 or fp16")
    return DTYPES_BY_NAME[name]


def _precision(raw: Mapping[str, Any]) -> tuple[MixedPrecision, LossScaling | None]:
    bf16, fp16 = _section(raw, "bf16"), _section(raw, "fp16")
    _reject_unknown("bf16.", bf16, BF16_KEYS)
    _reject_unknown("fp16.", fp16, FP16_KEYS)
    bf16_on = _bool(bf16.get("enabled", False), "bf16.enabled")
    fp16_on = _bool(fp16.get("enabled", False), "fp16.enabled")
    if bf16_on and fp16_on:
        raise ValueError("bf16.enabled and fp16.enabled are both true; enable at most one")
    scaling_keys = sorted(set(fp16) - {"enabled"})
    # Loss-scaling keys with no `enabled` leave it unclear whether fp16 was meant. With an explicit
    # `enabled: false` they are inert, as in DeepSpeed, and the templates that carry them load as they are.
    if scaling_keys and "enabled" not in fp16:
        raise ValueError(f"fp16.{scaling_keys[0]} is set but fp16.enabled is not; set fp16.enabled to true or false")
    param_dtype = torch.bfloat16 if bf16_on else torch.float16 if fp16_on else torch.float32
    reduce_dtype = _dtype(raw.get("communication_data_type", "fp32"), "communication_data_type")
    scaling = None
    if fp16_on:
        loss_scale = _finite(fp16.get("loss_scale", 0), "fp16.loss_scale")
        scaling = LossScaling(
            static_scale=loss_scale or None,
            initial_scale_power=_int(fp16.get("initial_scale_power", 16), "fp16.initial_scale_power"),
            window=_int(fp16.get("loss_scale_window", 1000), "fp16.loss_scale_window"),
            hysteresis=_int(fp16.get("hysteresis", 2), "fp16.hysteresis"),
            min_scale=_finite(fp16.get("min_loss_scale", 1.0), "fp16.min_loss_scale"),
        )
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype), scaling


def _bucket_bytes(zero: Mapping[str, Any], reduce_dtype: torch.dtype) -> int:
    if "reduce_bucket_size" in zero and "reduce_bucket_bytes" in zero:
        raise ValueError("give reduce_bucket_size (elements, DeepSpeed) or reduce_bucket_bytes, not both")
    if "reduce_bucket_size" in zero:  # DeepSpeed counts elements, not bytes
        elements = _int(zero["reduce_bucket_size"], "zero_optimization.reduce_bucket_size")
        if elements <= 0:
            raise ValueError(f"zero_optimization.reduce_bucket_size={zero['reduce_bucket_size']} must be > 0")
        return elements * torch.empty((), dtype=reduce_dtype).element_size()
    return _int(zero.get("reduce_bucket_bytes", DEFAULT_BUCKET_BYTES), "zero_optimization.reduce_bucket_bytes")


def _stage3(zero: Mapping[str, Any]) -> Stage3Policy:
    fields: dict[str, Any] = {}
    for key, name in STAGE3_KEYS.items():
        if key not in zero:
            continue
        if name in fields:
            raise ValueError(f"zero_optimization has both spellings of {name}; keep one")
        value = zero[key]
        if name != "unit_classes":
            fields[name] = _int(value, f"zero_optimization.{key}")
        elif isinstance(value, str):  # one class name, not a tuple of its letters
            fields[name] = (value,)
        elif isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            fields[name] = tuple(value)
        else:
            raise ValueError(f"zero_optimization.{key}={value!r} must be a module class name or a list of them, "
                             "like [\"LlamaDecoderLayer\"]")
    return Stage3Policy(**fields)


def _optional_int(raw: Mapping[str, Any], key: str, section: str = "") -> int | None:
    return None if raw.get(key) is None else _int(raw[key], f"{section}{key}")


def from_dict(raw: Mapping[str, Any]) -> ZeroConfig:
    """Build a ZeroConfig from DeepSpeed-style keys."""
    _reject_unknown("", raw, TOP_LEVEL_KEYS)
    zero = _section(raw, "zero_optimization")
    _reject_unknown("zero_optimization.", zero, ZERO_KEYS)
    if not _bool(zero.get("contiguous_gradients", True), "zero_optimization.contiguous_gradients"):
        raise ValueError("zero_optimization.contiguous_gradients=false is not supported; buckets are always contiguous")
    precision, scaling = _precision(raw)

    def flag(key: str, default: bool) -> bool:
        return _bool(zero.get(key, default), f"zero_optimization.{key}")

    config = ZeroConfig(
        stage=zero.get("stage", 0),
        precision=precision,
        loss_scaling=scaling,
        gradient_accumulation_steps=_int(raw.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps"),
        gradient_clipping=_finite(raw.get("gradient_clipping", 0.0), "gradient_clipping"),
        reduce_bucket_bytes=_bucket_bytes(zero, precision.reduce_dtype),
        sub_group_size=_optional_int(zero, "sub_group_size", "zero_optimization."),
        reduce_scatter=None if zero.get("reduce_scatter") is None else flag("reduce_scatter", True),  # null: auto
        overlap_comm=flag("overlap_comm", True),
        reduce_every_micro_step=flag("reduce_every_micro_step", True),
        stage3=_stage3(zero),
        max_consecutive_skipped_steps=_int(raw.get("max_consecutive_skipped_steps", 20),
                                           "max_consecutive_skipped_steps"),
        train_batch_size=_optional_int(raw, "train_batch_size"),
        train_micro_batch_size_per_gpu=_optional_int(raw, "train_micro_batch_size_per_gpu"),
    )
    # Checked once the stage itself is known to be valid. Stages 0-2 never read these keys, and a
    # stage-3 limit that silently does nothing is the kind of knob this reader exists to catch.
    stage3_keys = sorted(key for key in zero if key in STAGE3_KEYS)
    if stage3_keys and config.stage != 3:
        raise ValueError(f"zero_optimization.{stage3_keys[0]} is a stage-3 key but zero_optimization.stage="
                         f"{config.stage}; remove it or use stage 3")
    return config


def load_config(config: ZeroConfig | Mapping[str, Any] | str | Path | None) -> ZeroConfig:
    """Accept a ZeroConfig, a DeepSpeed-style dict, or the path of a JSON file."""
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {str(path)!r} must hold a JSON object")
        return from_dict(raw)
    if isinstance(config, Mapping):
        return from_dict(config)
    raise ValueError(f"config must be a ZeroConfig, a dict or a JSON file path, not {type(config).__name__}")


__all__ = ["ZeroConfig", "MixedPrecision", "LossScaling", "Stage3Policy", "load_config", "from_dict", "replace"]
