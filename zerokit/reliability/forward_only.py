"""Engines without an optimizer: the reference, reward and value models that post-training keeps beside the one
it trains (Hugging Face TRL prepares each with `deepspeed.initialize(model=m, config=...)` and no optimizer,
then `.eval()`).

[Note: an engine without an optimizer]
initialize() with no optimizer and no `optimizer` block builds an engine that runs forward only. It is the same
Engine over a model none of whose parameters it trains: the stage is built with no trainable parameter, so every
floating-point parameter, whatever its requires_grad, is what the stage calls frozen (See [Note: frozen
parameters at stage 3] in stages/stage3.py). At stage 3 each rank keeps its 1/N shard of each unit's parameters,
in the compute dtype, and a unit is gathered for its forward and freed after it, as the trained model's units
are; at stages 0-2 every rank holds the model. There is no master, gradient, optimizer state or bucket, so
memory_stats() counts parameters only. Checkpoints load into it by name (load_optimizer_states=False: a trained
engine's masters become its parameters), and zero.Init, from_pretrained and safetensors_init build it as they
build a trained one.

DeepSpeed 0.19.8 does the same: without an optimizer its stage-3 engine wraps the model in DeepSpeedZeRoOffload
(partitioned parameters, gathered per module), and its stage-0 engine holds the model whole.

What it refuses: engine.backward() and engine.step(), in one line naming the engine. A parameter with
requires_grad=True in such an engine trains nothing (DeepSpeed keeps it as it is, and says nothing): the engine
says so once at start, and a gradient that autograd computes for it anyway (a loss backpropagated through the
reference model by mistake) raises in one line naming the engine and the parameter, instead of leaving a full
gradient nobody reduces or steps in the parameter's .grad. A forward under torch.no_grad(), as TRL runs its
reference model, computes no gradient and meets none of this.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerokit._support.log import configure_logging
from zerokit._support.log import logger


def engine_name(model: nn.Module) -> str:
    """How errors name a forward-only engine: by the model it holds."""
    return f"the engine over {type(model).__name__} built without an optimizer"


def refused(call: str, model: nn.Module) -> RuntimeError:
    """The one-line error for a training call on a forward-only engine."""
    return RuntimeError(f"engine.{call}() on {engine_name(model)}: it runs forward only (a reference or reward "
                        "model); pass an optimizer to initialize(), or an 'optimizer' block in the config, to train")


class ForwardOnlyGuard:
    """What an engine without an optimizer adds to the training loop's safeguards (zerokit/reliability): says at
    start what it is (and, as a warning, that requires_grad parameters train nothing), refuses backward() and
    step(), and raises where autograd computes a gradient for one of its parameters. See [Note: an engine without
    an optimizer]."""

    def __init__(self, model: nn.Module, rank: int, scheduler_given: bool = False) -> None:
        self.model = model
        self.handles = refuse_gradients(model)
        if rank == 0:
            configure_logging()
            for line in startup_lines(model, scheduler_given):
                logger.info(line)
            for line in trainable_warnings(model):
                logger.warning(line)

    def refuse(self, call: str) -> None:
        raise refused(call, self.model)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def startup_lines(model: nn.Module, scheduler_given: bool = False) -> list[str]:
    """The start-up log's lines for a forward-only engine."""
    count = sum(1 for _ in model.parameters())
    lines = [f"no optimizer and no 'optimizer' block: {engine_name(model)} runs forward only; its {count} "
             "parameters are held as frozen ones (no masters, gradients or optimizer state)"]
    if scheduler_given:
        lines.append("the config's 'scheduler' block has no optimizer to schedule in an engine without one: ignored")
    return lines


def trainable_warnings(model: nn.Module) -> list[str]:
    """The once-at-start warning for parameters that ask for gradients an engine without an optimizer never
    uses; none when every parameter is frozen."""
    asking = [name for name, param in model.named_parameters() if param.requires_grad]
    if not asking:
        return []
    return [f"{engine_name(model)} has {len(asking)} parameter(s) with requires_grad=True (first: {asking[0]!r}): "
            "it trains nothing, so they stay as loaded; run it under torch.no_grad(), or freeze them with "
            "requires_grad_(False), and pass an optimizer to the engine that trains"]


def refuse_gradients(model: nn.Module) -> list[RemovableHandle]:
    """A hook on every parameter with requires_grad=True that raises when autograd computes its gradient (See
    [Note: an engine without an optimizer])."""
    return [param.register_hook(partial(_refuse_gradient, engine_name(model), name))
            for name, param in model.named_parameters() if param.requires_grad]


def _refuse_gradient(engine: str, name: str, grad: torch.Tensor) -> None:
    raise RuntimeError(f"a backward reached parameter {name!r} of {engine}, which trains nothing: compute its "
                       "outputs under torch.no_grad() (or detach them), or pass an optimizer to train it")


__all__ = ["ForwardOnlyGuard", "engine_name", "refused", "startup_lines", "trainable_warnings", "refuse_gradients"]
