"""The user's optimizers, checked against the model, classified, and rebuilt over this rank's masters
with their param groups and hyperparameters kept.

[Note: element-wise and whole-tensor optimizers]
Sharding an optimizer's state by position is exact only if the optimizer updates each element from
that element's own gradient and state (SGD, Adam, AdamW, ...): then a slice of a tensor is stepped
exactly as the whole would be. An optimizer that looks across a tensor (Muon orthogonalises each matrix,
Adafactor factors each matrix's second moment) must see whole tensors, so its parameters are owned whole
by one rank each (See [Note: buckets owned by one rank] in flat/layout.py). zerokit knows which kind
torch's optimizers are; any other class must be declared, or it is refused: guessing wrong would train
wrong without a word.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn

ELEMENTWISE, WHOLE_TENSOR = "elementwise", "whole_tensor"
KINDS = (ELEMENTWISE, WHOLE_TENSOR)
KNOWN_KINDS: dict[type, str] = {
    **{cls: ELEMENTWISE for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                                    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
                                    torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)},
    torch.optim.Muon: WHOLE_TENSOR,
    torch.optim.Adafactor: WHOLE_TENSOR,
}
# Optimizers whose step() calls a closure that runs forward and backward again: engine.step() has none.
CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


@dataclass(frozen=True)
class GroupRef:
    """Where a flattened param group comes from: optimizer `optimizer`'s group `group`."""

    optimizer: int
    group: int
    whole_tensor: bool
    fused: bool = False
    """Its optimizer steps it with a fused kernel, one pass over each tensor (See [Note: optimizer pieces] in
    masters/shards.py)."""


def optimizer_kind(optimizer: torch.optim.Optimizer, declared: Mapping[Any, str], allow_untested: bool) -> str:
    """ELEMENTWISE or WHOLE_TENSOR (See [Note: element-wise and whole-tensor optimizers]): as declared in the
    config (by class or class name), or by the class itself (a `zerokit_kind` attribute), or known to
    zerokit (torch's optimizers, and subclasses that do not override step()); else refused."""
    cls = type(optimizer)
    if isinstance(optimizer, CLOSURE_OPTIMIZERS):
        raise ValueError(f"{cls.__name__} calls a closure several times per step, and engine.step() takes none; "
                         "use an optimizer that steps once per backward (AdamW, SGD, Muon, ...)")
    kind = declared.get(cls, declared.get(cls.__name__, getattr(cls, "zerokit_kind", None)))
    if kind is None:
        kind = next((k for known, k in KNOWN_KINDS.items() if isinstance(optimizer, known) and cls.step is known.step),
                    None)
    if kind is None and allow_untested:
        kind = ELEMENTWISE  # DeepSpeed's zero_allow_untested_optimizer: the user vouches for it
    if kind is None:
        raise ValueError(f"zerokit does not know whether {cls.__name__} updates each element on its own or looks at "
                         f"whole tensors; declare it with ZeroConfig(optimizer_kinds={{{cls.__name__}: "
                         "'elementwise' or 'whole_tensor'}), or set zero_allow_untested_optimizer: true to treat "
                         "it as element-wise")
    if kind not in KINDS:
        raise ValueError(f"optimizer kind {kind!r} for {cls.__name__} is not one of {', '.join(KINDS)}")
    return kind


def fused_group(group: dict[str, Any]) -> bool:
    """A param group its optimizer steps with a fused kernel (torch's fused=True): See [Note: optimizer pieces] in
    masters/shards.py."""
    return group.get("fused") is True


def trainable_groups(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                     kinds: Sequence[str]) -> tuple[list[list[nn.Parameter]], list[GroupRef]]:
    """The trainable parameters of every param group of every optimizer (flattened, in order), checked
    against the model, and where each group comes from.

    Frozen parameters (requires_grad=False) are dropped: they get no gradient, no optimizer state and
    no communication, exactly as a torch optimizer skips a parameter whose grad is None.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    seen: set[int] = set()
    groups: list[list[nn.Parameter]] = []
    refs: list[GroupRef] = []
    for which, (optimizer, kind) in enumerate(zip(optimizers, kinds)):
        if any(len(state) for state in optimizer.state.values()):
            raise ValueError("the optimizer already has state; pass a freshly built optimizer to initialize()")
        for index, group in enumerate(optimizer.param_groups):
            groups.append(_check_group(group["params"], index, names, seen))
            refs.append(GroupRef(which, index, kind == WHOLE_TENSOR, fused_group(group)))
    orphans = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if orphans:
        raise ValueError(f"parameter {orphans[0]!r} requires grad but is in no optimizer param group; "
                         "add it to the optimizer or freeze it with requires_grad_(False)")
    return groups, refs


def _check_group(params: list[nn.Parameter], index: int, names: dict[int, str], seen: set[int]) -> list[nn.Parameter]:
    trainable = []
    for param in params:
        if id(param) not in names:
            raise ValueError(f"optimizer param group {index} holds a parameter of shape {tuple(param.shape)} "
                             "that is not in the model")
        if id(param) in seen:
            raise ValueError(f"parameter {names[id(param)]!r} is in more than one optimizer param group")
        seen.add(id(param))
        if param.requires_grad:
            trainable.append(param)
    return trainable


def rebuild_optimizer(optimizer: torch.optim.Optimizer,
                      pieces_by_group: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
    """A new optimizer of the user's class over `pieces_by_group`, every group's hyperparameters kept."""
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": pieces}
              for group, pieces in zip(optimizer.param_groups, pieces_by_group)]
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)
