"""The optimizer and LR schedule a DeepSpeed config's `optimizer` and `scheduler` blocks name.

    build_optimizer(spec, parameters)  -> list[torch.optim.Optimizer]   (two for Muon: Muon + AdamW)
    build_scheduler(spec, optimizers)  -> list[DeepSpeedLR]             (one per optimizer)
    both_given_error("optimizer")      -> the ValueError for an optimizer passed *and* named in the config
                                          (and "scheduler" for an lr_scheduler and a `scheduler` block)

[Note: DeepSpeed's schedules as torch schedulers]
DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py) count `last_batch_iteration` from -1 at
construction and step once per optimizer step that was not skipped; the learning rate after n steps is their
formula at iteration n - 1, and at construction the formula's "before the start" value (WarmupLR: the minimum;
WarmupCosineLR: 0). torch's LRScheduler counts `last_epoch` from 0 at construction, so DeepSpeedLR evaluates
the same formulas at iteration last_epoch - 1. The formulas are the module-level functions below, written
from DeepSpeed's code line by line (tests/test_schedules.py checks them step by step, and against DeepSpeed's
own classes when it is installed). The engine should step the schedule only on steps it did not skip, as
DeepSpeed does.

[Note: fused optimizer kernels]
Where DeepSpeed builds an `optimizer` block's Adam it builds its own fused kernel (FusedAdam on a GPU,
DeepSpeedCPUAdam for offloaded states), not torch's default for-loop. zerokit builds torch's Adam, AdamW and SGD
with fused=True, torch's one-kernel step (CPU and CUDA alike, where the fp32 masters may live; Adagrad's fused
kernel is CPU-only, so Adagrad keeps torch's default). On this 2-core CPU (shared: load 5-8 while measured), a
step over 10.9M fp32 elements in the engine's 64K-element pieces was 3.1-4.3x faster fused for AdamW and 1.7-2.1x
for SGD, 8.7-8.9x for AdamW over whole tensors (two runs of benchmarks/bench_optimizer_step.py, 1 thread). Fused
results differ from the default's in the last bit (another order of the same operations) but not with the piece
size, so a reference built with the same block matches the engine as closely as with any torch optimizer. A
block that names foreach, fused or differentiable keeps what it says.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from zerokit.config.dsconfig.blocks import OptimizerSpec, SchedulerSpec
from zerokit._support.log import logger


# --- the formulas: learning rate (or ratio, or momentum) at DeepSpeed's last_batch_iteration ------------

def warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """WarmupLR._get_gamma during warm-up (iteration < warmup_num_steps), 1.0 after."""
    if iteration < warmup_num_steps:
        if warmup_type == "log":
            return math.log(iteration + 1) / math.log(warmup_num_steps)
        return iteration / warmup_num_steps
    return 1.0


def warmup_lr(iteration: int, min_lr: float, max_lr: float, warmup_num_steps: int, warmup_type: str) -> float:
    if iteration < 0:
        return min_lr
    return min_lr + (max_lr - min_lr) * warmup_gamma(iteration, max(2, warmup_num_steps), warmup_type)


def warmup_decay_lr(iteration: int, min_lr: float, max_lr: float, warmup_num_steps: int, warmup_type: str,
                    total_num_steps: int) -> float:
    if iteration < 0:
        return min_lr
    steps = max(2, warmup_num_steps)
    if iteration < steps:
        gamma = warmup_gamma(iteration, steps, warmup_type)
    else:
        gamma = max(0.0, float(total_num_steps - iteration) / float(max(1.0, total_num_steps - steps)))
    return min_lr + (max_lr - min_lr) * gamma


def warmup_cosine_ratio(iteration: int, total_num_steps: int, warmup_min_ratio: float, warmup_num_steps: int,
                        cos_min_ratio: float, warmup_type: str) -> float:
    """WarmupCosineLR.get_lr_ratio: the share of the optimizer's lr (0 before the first step)."""
    if iteration < 0:
        return 0.0
    steps = max(2, warmup_num_steps)
    if iteration < steps:
        ratio = warmup_gamma(iteration, steps, warmup_type)
        return warmup_min_ratio + ratio * (1.0 - warmup_min_ratio)
    progress = min(1.0, (iteration - steps + 1) / max(1, total_num_steps - steps))
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def lr_range_test_lr(iteration: int, min_lr: float, step_size: int, step_rate: float, staircase: bool) -> float:
    interval = (iteration + 1) / step_size
    return min_lr * (1 + step_rate * (math.floor(interval) if staircase else interval))


def one_cycle_scale(iteration: int, first: float, second: float, first_stairs: int, second_stairs: int) -> float:
    """OneCycle._get_scale_factor: where in the cycle this step is, 0 at the low end and 1 at the peak."""
    batch, total = iteration + 1, first + second
    step_ratio = first / total
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    if x <= step_ratio:
        scale, stairs = x / step_ratio, first_stairs
    else:
        scale, stairs = (x - 1) / (step_ratio - 1), second_stairs
    if stairs > 0:  # quantised from the integer offset, as DeepSpeed does, so a peak is not lost to rounding
        offset = batch % total
        position = offset * stairs / first if offset <= first else (total - offset) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def one_cycle_lr(iteration: int, p: dict[str, Any], min_lr: float, max_lr: float) -> float:
    first, second, total = _cycle_sizes(p)
    if iteration < total:
        scale = one_cycle_scale(iteration, first, second, p["cycle_first_stair_count"], _second_stairs(p))
        return min_lr + (max_lr - min_lr) * scale
    if _close_to_zero(p["decay_step_size"]) or _close_to_zero(p["decay_lr_rate"]):
        return min_lr
    return min_lr / (1 + p["decay_lr_rate"] * (iteration - total + 1) / p["decay_step_size"])


def one_cycle_momentum(iteration: int, p: dict[str, Any], min_mom: float, max_mom: float) -> float:
    """beta1 of OneCycle's cycled momentum (beta2 is held at 0.99, as DeepSpeed does)."""
    first, second, total = _cycle_sizes(p)
    if iteration < total:
        scale = one_cycle_scale(iteration, first, second, p["cycle_first_stair_count"], _second_stairs(p))
        return max_mom - (max_mom - min_mom) * scale
    if _close_to_zero(p["decay_step_size"]) or _close_to_zero(p["decay_mom_rate"]):
        return max_mom
    return max_mom * (1 + p["decay_mom_rate"] * (iteration - total + 1) / p["decay_step_size"])


def _cycle_sizes(p: dict[str, Any]) -> tuple[float, float, float]:
    first = float(p["cycle_first_step_size"])
    second = float(p["cycle_second_step_size"]) if p["cycle_second_step_size"] is not None else first
    return first, second, first + second


def _second_stairs(p: dict[str, Any]) -> int:
    second = p["cycle_second_stair_count"]
    return p["cycle_first_stair_count"] if second is None else second


def _close_to_zero(value: float) -> bool:
    return math.isclose(value, 0)


# --- the schedules, as torch LR schedulers --------------------------------------------------------------

PER_GROUP = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom",
             "lr_range_test_min_lr")
"""Parameters DeepSpeed takes as one number or one per parameter group."""


class DeepSpeedLR(torch.optim.lr_scheduler.LRScheduler):
    """One of DeepSpeed's schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) with its
    exact formula. See [Note: DeepSpeed's schedules as torch schedulers]."""

    def __init__(self, optimizer: torch.optim.Optimizer, spec: SchedulerSpec) -> None:
        self.kind = spec.type
        self.params = _checked_params(spec)  # plain data only: torch's state_dict() saves every attribute
        self.group_values = {name: _per_group(optimizer, self.params[name], name) for name in PER_GROUP
                             if self.params.get(name) is not None}
        self.cycle_momentum = self.kind == "OneCycle" and bool(self.params["cycle_momentum"])
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            logger.warning("scheduler OneCycle: cycle_momentum is off because %s has no betas (as in DeepSpeed)",
                           type(optimizer).__name__)
            self.cycle_momentum = False
        super().__init__(optimizer)
        if self.cycle_momentum:  # DeepSpeed starts beta1 at the cycle's minimum momentum
            for group, momentum in zip(optimizer.param_groups, self.group_values["cycle_min_mom"]):
                group["betas"] = (momentum, 0.99)

    def get_lr(self) -> list[float]:
        iteration = self.last_epoch - 1
        return [self._lr(iteration, index, base) for index, base in enumerate(self.base_lrs)]

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None:
            raise ValueError("DeepSpeed's schedules step once per optimizer step; resume with load_state_dict")
        super().step()
        if self.cycle_momentum and self.last_epoch > 0:
            for index, group in enumerate(self.optimizer.param_groups):
                beta1 = one_cycle_momentum(self.last_epoch - 1, self.params, self.group_values["cycle_min_mom"][index],
                                           self.group_values["cycle_max_mom"][index])
                group["betas"] = (beta1, 0.99)

    def _lr(self, iteration: int, index: int, base_lr: float) -> float:
        p, group = self.params, {name: values[index] for name, values in self.group_values.items()}
        if self.kind == "WarmupLR":
            return warmup_lr(iteration, group["warmup_min_lr"], group.get("warmup_max_lr", base_lr),
                             p["warmup_num_steps"], p["warmup_type"])
        if self.kind == "WarmupDecayLR":
            return warmup_decay_lr(iteration, group["warmup_min_lr"], group["warmup_max_lr"], p["warmup_num_steps"],
                                   p["warmup_type"], p["total_num_steps"])
        if self.kind == "WarmupCosineLR":
            return base_lr * warmup_cosine_ratio(iteration, p["total_num_steps"], p["warmup_min_ratio"],
                                                 p["warmup_num_steps"], p["cos_min_ratio"], p["warmup_type"])
        if self.kind == "OneCycle":
            return one_cycle_lr(iteration, p, group["cycle_min_lr"], group["cycle_max_lr"])
        return lr_range_test_lr(iteration, group["lr_range_test_min_lr"], p["lr_range_test_step_size"],
                                p["lr_range_test_step_rate"], p["lr_range_test_staircase"])


def _checked_params(spec: SchedulerSpec) -> dict[str, Any]:
    """Every parameter, given or default, with the ranges DeepSpeed's constructors enforce."""
    params = spec.kwargs()
    positive = {"warmup_num_steps", "lr_range_test_step_size", "total_num_steps"}
    for name in positive & params.keys():
        if params[name] is not None and params[name] < 1:
            raise ValueError(f"scheduler.params.{name}={params[name]} must be a positive whole number")
    if spec.type == "OneCycle":
        if params["cycle_first_step_size"] <= 0:
            raise ValueError(f"scheduler.params.cycle_first_step_size={params['cycle_first_step_size']} must be > 0")
        if params["cycle_second_step_size"] is not None and params["cycle_second_step_size"] < 0:
            raise ValueError("scheduler.params.cycle_second_step_size must be >= 0")
    return params


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"scheduler.params.{name} has {len(value)} values but the optimizer has {groups} "
                             "parameter groups")
        return [float(item) for item in value]
    return [float(value)] * groups


def build_scheduler(spec: SchedulerSpec,
                    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> list[DeepSpeedLR]:
    """The `scheduler` block's schedule over each optimizer (Muon's two included), stepped together."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    return [DeepSpeedLR(optimizer, spec) for optimizer in optimizers]


# --- the optimizer an `optimizer` block names -----------------------------------------------------------

ADAM_FLAGS = ("amsgrad", "foreach", "fused", "maximize", "capturable", "differentiable")
TORCH_KEYS = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "differentiable",
            "fused"),
    "Adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "foreach", "maximize",
                "differentiable", "fused"),
}
MUON_HALF = ("lr", "momentum", "weight_decay")
ADAM_HALF = ("lr", "betas", "eps", "weight_decay")
Group = dict[str, Any]


def build_optimizer(spec: OptimizerSpec, parameters: nn.Module | Iterable[Any]) -> list[torch.optim.Optimizer]:
    """The torch optimizer(s) an `optimizer` block names, over `parameters` (a module, tensors, (name, tensor)
    pairs or param-group dicts), with DeepSpeed's defaults for what the block leaves out. Adam with adam_w_mode
    (the default) is torch.optim.AdamW, without it torch.optim.Adam; Muon is torch.optim.Muon over the 2-D
    hidden matrices and AdamW over everything else, so it returns two optimizers."""
    groups = _groups(parameters)
    if spec.type == "Muon":
        return _muon(spec, groups)
    if spec.type in ("Adam", "AdamW"):
        cls = torch.optim.AdamW if spec.adam_w_mode else torch.optim.Adam
        names = ("lr", "betas", "eps", "weight_decay")
        kwargs = {**{name: spec.value(name) for name in names},
                  **{name: value for name, value in spec.params if name in ADAM_FLAGS}}
    else:
        cls = getattr(torch.optim, spec.type)
        given = dict(spec.params)
        kwargs = {name: spec.value(name) for name in TORCH_KEYS[spec.type] if name in given or name in ("lr",)}
        kwargs.update({name: spec.value(name) for name in ("weight_decay", "eps") if name in TORCH_KEYS[spec.type]})
    return [cls(_tensors_only(groups), **kwargs, **fused_kernel(cls, dict(spec.params)))]


FUSED_KERNELS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""torch optimizers with a fused step on both the CPU and CUDA (See [Note: fused optimizer kernels])."""


def fused_kernel(cls: type, given: dict[str, Any]) -> dict[str, bool]:
    """fused=True where torch has a fused kernel for `cls` and the block chose no other implementation."""
    chosen = "fused" in given or given.get("foreach") or given.get("differentiable")
    return {"fused": True} if cls in FUSED_KERNELS and not chosen else {}


def _groups(parameters: nn.Module | Iterable[Any]) -> list[Group]:
    """Param groups whose params are (name or None, tensor) pairs; a module gives its trainable parameters."""
    if isinstance(parameters, nn.Module):
        # Embedding tables are named so, whatever the model calls them, for the Muon rule below.
        embeddings = {id(p) for m in parameters.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        return [{"params": [(f"{name} (embedding)" if id(p) in embeddings else name, p)
                            for name, p in parameters.named_parameters() if p.requires_grad]}]
    groups, loose = [], []
    for item in parameters:
        if isinstance(item, dict):
            groups.append({**item, "params": [_named(p) for p in item["params"]]})
        else:
            loose.append(_named(item))
    if loose or not groups:
        groups.append({"params": loose})
    return groups


def _named(item: Any) -> tuple[str | None, torch.Tensor]:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return item
    return None, item


def _tensors_only(groups: list[Group]) -> list[Group]:
    return [{**group, "params": [p for _, p in group["params"]]} for group in groups]


def _is_hidden_matrix(name: str | None, param: torch.Tensor) -> bool:
    """DeepSpeed's Muon rule (set_optimizer_flags): matrices, except embeddings and the output head, which
    names alone can tell. torch.optim.Muon takes 2-D parameters only, so convolution kernels go to AdamW."""
    lowered = (name or "").lower()
    return param.dim() == 2 and "embed" not in lowered and "lm_head" not in lowered


def _muon(spec: OptimizerSpec, groups: list[Group]) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon over the hidden matrices and AdamW (Adam without adam_w_mode) over the rest. Each
    half's settings: the block's shared value, then muon_lr / adam_lr, then the group's own (as DeepSpeed)."""
    given = dict(spec.params)
    muon_defaults = {"lr": given.get("muon_lr", given.get("lr", 0.02)), "momentum": spec.value("momentum"),
                     "weight_decay": spec.value("weight_decay")}
    adam_defaults = {"lr": given.get("adam_lr", given.get("lr", 3e-4)), "betas": spec.value("betas"),
                     "eps": spec.value("eps"), "weight_decay": spec.value("weight_decay")}
    muon_groups, adam_groups = [], []
    for group in groups:
        overrides = {key: value for key, value in group.items() if key != "params"}
        trainable = [(name, p) for name, p in group["params"] if p.requires_grad]
        hidden = [p for name, p in trainable if _is_hidden_matrix(name, p)]
        rest = [p for name, p in trainable if not _is_hidden_matrix(name, p)]
        if hidden:
            muon_groups.append({**muon_defaults, **_pick(overrides, MUON_HALF), "params": hidden})
        if rest:
            adam_groups.append({**adam_defaults, **_pick(overrides, ADAM_HALF), "params": rest})
    out: list[torch.optim.Optimizer] = []
    if muon_groups:
        out.append(torch.optim.Muon(muon_groups, nesterov=True, ns_steps=5))
    if adam_groups:
        cls = torch.optim.AdamW if spec.adam_w_mode else torch.optim.Adam
        out.append(cls(adam_groups, **fused_kernel(cls, given)))
    return out


def _pick(overrides: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: value for key, value in overrides.items() if key in keys}


# --- the error the engine raises -----------------------------------------------------------------------

def both_given_error(kind: str = "optimizer") -> ValueError:
    """The error for initialize() given an optimizer (or lr_scheduler) while the config has an `optimizer` (or
    `scheduler`) block. DeepSpeed 0.19.8 silently prefers the passed object; zerokit will not guess which one
    was meant (the one-line refusal is Hugging Face accelerate's)."""
    if kind not in ("optimizer", "scheduler"):
        raise ValueError(f"kind={kind!r} must be 'optimizer' or 'scheduler'")
    block, argument = ("an 'optimizer'", "optimizer") if kind == "optimizer" else ("a 'scheduler'", "lr_scheduler")
    return ValueError(f"initialize() got an {argument} and the config has {block} block; remove one: pass "
                      f"{argument}=None to build it from the block, or delete the block to use yours")


__all__ = ["DeepSpeedLR", "build_optimizer", "build_scheduler", "both_given_error", "warmup_lr", "warmup_decay_lr",
           "warmup_cosine_ratio", "one_cycle_lr", "one_cycle_momentum", "lr_range_test_lr"]
