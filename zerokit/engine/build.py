"""What the engine builds and checks from a DeepSpeed config besides the stage: the optimizer its `optimizer`
block names, the LR schedule of its `scheduler` block, the learning rates it reports, and whether the
accumulation dtype asked for (data_types.grad_accum_dtype) is the one this stage accumulates in.

[Note: the schedule follows the rebuilt optimizers]
The engine rebuilds the user's optimizer over this rank's fp32 master pieces (masters/optimizer.py), keeping
every param group's hyperparameters. The `scheduler` block's schedule is built over those rebuilt optimizers,
after the stage, so the learning rate it sets is the one the optimizer step reads; it is stepped once per
optimizer step that was not skipped (an fp16 overflow, a non-finite gradient), as DeepSpeed steps it, so a
skipped step does not eat into the warm-up.

[Note: where gradients accumulate]
Across the micro-steps of a window, zerokit accumulates gradients where the stage keeps them: stages 0 and 1
add each micro-step's full gradient into one buffer in the compute dtype (autograd adds into `param.grad`,
which has the parameter's dtype); stage 2 (reducing every micro-step, its default) and stage 3 add each
micro-step's reduced shard into a shard in communication_data_type (fp32 unless set); stage 2 with
reduce_every_micro_step=false keeps full compute-dtype gradients until the boundary. `grad_accum_dtype` is
honoured where it names that dtype, and trivially with gradient_accumulation_steps=1 (nothing accumulates).
Accumulating stage 0-1 gradients in fp32 under bf16 compute would take a second, fp32 gradient buffer fed by
hooks instead of autograd's own accumulation: a deep change for what stage 2 already offers, so that
combination is refused in one line that says which stage or setting does accumulate in that dtype.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from zerokit.config.typed import DTYPE_NAMES as NAMES, ZeroConfig
from zerokit.config.settings import reduces_every_micro_step as reduces_every_micro_step_at
from zerokit.engine.schedules import DeepSpeedLR, both_given_error, build_optimizer, build_scheduler



def optimizers_for(model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None,
                   config: ZeroConfig, model_parameters: Iterable[Any] | None) -> list[torch.optim.Optimizer]:
    """The optimizers to train with: those given, or those the config's `optimizer` block names, built over
    `model_parameters` (tensors, (name, tensor) pairs or param-group dicts; default: the model's trainable
    parameters). Both is a one-line error; neither gives none: an engine that runs forward only (See [Note: an
    engine without an optimizer] in zerokit/reliability/forward_only.py)."""
    if optimizer is not None:
        if config.optimizer is not None:
            raise both_given_error("optimizer")
        return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if config.optimizer is None:
        return []
    built = build_optimizer(config.optimizer, model if model_parameters is None else model_parameters)
    for optimizer in built:
        # Adagrad fills its state at construction (the initial accumulator); the engine rebuilds the optimizer
        # over the masters, which fills it again, so this fresh one has nothing to keep.
        optimizer.state.clear()
    return built


def lr_schedules_for(config: ZeroConfig, optimizers: list[torch.optim.Optimizer]) -> list[DeepSpeedLR]:
    """The `scheduler` block's schedule over each rebuilt optimizer (See [Note: the schedule follows the
    rebuilt optimizers]); none without a block."""
    return build_scheduler(config.scheduler, optimizers) if config.scheduler is not None else []


def learning_rates(optimizers: list[torch.optim.Optimizer]) -> list[float]:
    """Every param group's current learning rate, optimizer by optimizer (DeepSpeed's engine.get_lr())."""
    return [float(group["lr"]) for optimizer in optimizers for group in optimizer.param_groups]


def reduces_every_micro_step(config: ZeroConfig) -> bool:
    """Stage 3, and stage 2 by default, reduce each micro-step's gradients and accumulate the reduced shards."""
    return reduces_every_micro_step_at(config.stage, config.reduce_every_micro_step)


def accumulation_dtype(config: ZeroConfig) -> torch.dtype:
    """The dtype this configuration accumulates gradients in across micro-steps (See [Note: where gradients
    accumulate])."""
    return config.precision.reduce_dtype if reduces_every_micro_step(config) else config.precision.param_dtype


def grad_accum_dtype_lines(config: ZeroConfig) -> list[str]:
    """Start-up log lines for data_types.grad_accum_dtype, or a one-line error for a dtype this stage does not
    accumulate in. See [Note: where gradients accumulate]."""
    wanted = config.grad_accum_dtype
    if wanted is None:
        return []
    actual, key = accumulation_dtype(config), f"data_types.grad_accum_dtype={NAMES[wanted]}"
    if wanted == actual:
        return [f"{key}: gradients accumulate across micro-steps in {NAMES[actual]} at stage {config.stage}"]
    if config.gradient_accumulation_steps == 1:
        return [f"{key}: accepted; with gradient_accumulation_steps=1 nothing accumulates across micro-steps"]
    setting = f"{key} with {NAMES[config.precision.param_dtype]} compute at zero_optimization.stage={config.stage}"
    if not reduces_every_micro_step(config):
        raise ValueError(f"{setting} is not offered: this stage accumulates full gradients in the compute dtype "
                         f"({NAMES[actual]}); stages 2-3 accumulate in communication_data_type, so use stage 2 or 3 "
                         f"with communication_data_type={NAMES[wanted]}, or drop the key")
    raise ValueError(f"{setting} is not offered: this stage accumulates reduced shards in communication_data_type "
                     f"({NAMES[actual]}); set communication_data_type={NAMES[wanted]}, or drop the key")


__all__ = ["optimizers_for", "lr_schedules_for", "learning_rates", "reduces_every_micro_step", "accumulation_dtype",
           "grad_accum_dtype_lines"]
