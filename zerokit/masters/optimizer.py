"""The user's optimizer, rebuilt over this rank's fp32 master shards with its param groups kept."""

from __future__ import annotations

import inspect

import torch
from torch import nn


def trainable_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    """The trainable parameters of each optimizer param group, checked against the model.

    Frozen parameters (requires_grad=False) are dropped: they get no gradient, no optimizer state and
    no communication, exactly as a torch optimizer skips a parameter whose grad is None.
    """
    if any(len(state) for state in optimizer.state.values()):
        raise ValueError("the optimizer already has state; pass a freshly built optimizer to initialize()")
    names = {id(p): name for name, p in model.named_parameters()}
    seen: set[int] = set()
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        trainable = []
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(f"optimizer param group {index} holds a parameter of shape {tuple(param.shape)} "
                                 "that is not in the model")
            if id(param) in seen:
                raise ValueError(f"parameter {names[id(param)]!r} is in more than one optimizer param group")
            seen.add(id(param))
            if param.requires_grad:
                trainable.append(param)
        groups.append(trainable)
    orphans = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if orphans:
        raise ValueError(f"parameter {orphans[0]!r} requires grad but is in no optimizer param group; "
                         "add it to the optimizer or freeze it with requires_grad_(False)")
    return groups


def rebuild_optimizer(optimizer: torch.optim.Optimizer,
                      masters_by_group: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
    """A new optimizer of the user's class over `masters_by_group`, every group's hyperparameters kept.

    Sharding the optimizer is exact for element-wise optimizers (SGD, Adam, AdamW, ...): each element's
    update depends only on that element's gradient and state. Optimizers that look across a whole tensor
    (LAMB, Adafactor, Shampoo) would see a shard instead of a tensor.
    """
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": masters}
              for group, masters in zip(optimizer.param_groups, masters_by_group)]
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)
