"""A model's parameters as the engine will see them (`ParamInventory`), read from the real module.

The planner's exact engine model (zerokit/planner/engine_model.py) needs each parameter's size,
optimizer param group and stage-3 unit in registration order, and which are MoE experts split over ranks
(held by a stage of their own); this is the one place that reads them from torch objects.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import nn

from zerokit.planner.engine_model import ParamEntry, ParamInventory
from zerokit.reliability.buffers import buffer_groups


def _group_of(model: nn.Module, param_groups: Any) -> dict[int, int]:
    """id(param) -> index of its optimizer param group; one group when none are given."""
    if param_groups is None:
        return {id(p): 0 for p in model.parameters()}
    groups = param_groups.param_groups if isinstance(param_groups, torch.optim.Optimizer) else param_groups
    found = {}
    for index, group in enumerate(groups):
        params = group["params"] if isinstance(group, dict) else group
        for param in params:
            found[id(param)] = index
    return found


def _unit_of(model: nn.Module, stage3: Any, experts: frozenset[int]) -> dict[int, int]:
    """id(param) -> its stage-3 unit, found exactly as the engine finds units (zerokit.stages.units): the dense
    stage's, which leave split experts out (`experts`, their ids: See [Note: split experts in a ZeRO-3 job] in
    zerokit/parallel/experts/share.py)."""
    from zerokit.config.typed import Stage3Policy
    from zerokit.stages.units import find_units

    units = find_units(model, stage3 if stage3 is not None else Stage3Policy(), held_elsewhere=experts)
    return {param_id: unit.index for unit in units for param_id in unit.param_ids}


def _expert_units(model: nn.Module, stage3: Any) -> dict[int, int]:
    """id(param) -> its unit in the split experts' own stage, for every parameter of the model's MoE experts split
    over ranks (none split: empty). As ExpertShare.part sets that stage: each local expert a unit, none kept whole
    with the root (See [Note: split experts in the engine model] in zerokit/planner/engine_model.py)."""
    from zerokit.config.typed import Stage3Policy
    from zerokit.parallel.experts.share import expert_layers
    from zerokit.stages.units import find_units

    layers = [layer for layer in expert_layers(model) if layer.ep > 1]
    experts = {id(param) for layer in layers for param in layer.experts.parameters()}
    if not experts:
        return {}
    policy = replace(stage3 if stage3 is not None else Stage3Policy(), unit_classes=(),
                     units=tuple(expert for layer in layers for expert in layer.experts), persistence_threshold=0)
    dense = frozenset(id(param) for param in model.parameters()) - experts
    units = find_units(model, policy, held_elsewhere=dense)
    return {param_id: unit.index for unit in units for param_id in unit.param_ids if param_id in experts}


def param_inventory(model: nn.Module, param_groups: Any = None, stage3: Any = None,
                    source: str = "") -> ParamInventory:
    """`param_groups`: the optimizer (or its param groups, or lists of parameters) you pass to
    zerokit.initialize; `stage3`: the config's `Stage3Policy` (default: the engine's default policy)."""
    group_of = _group_of(model, param_groups)
    expert_unit = _expert_units(model, stage3)
    unit_of = _unit_of(model, stage3, frozenset(expert_unit)) | expert_unit
    entries, fixed = [], 0
    for name, param in model.named_parameters():
        trainable = param.requires_grad and id(param) in group_of
        floating = param.is_floating_point()
        if not trainable and not floating:
            fixed += param.numel() * param.element_size()
        entries.append(ParamEntry(name=name, numel=param.numel(),
                                  group=group_of.get(id(param), -1) if trainable else -1,
                                  unit=unit_of.get(id(param), 0), trainable=trainable, floating=floating,
                                  expert=id(param) in expert_unit))
    return ParamInventory(tuple(entries), fixed, source or type(model).__name__, _buffers(model))


def _buffers(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """(elements, bytes per element) of each flat tensor broadcast_buffers sends."""
    return tuple((sum(b.numel() for b in group), dtype.itemsize) for (dtype, _), group in buffer_groups(model).items())


def blocks_of(model: nn.Module) -> Sequence[nn.Module]:
    """The repeated blocks: members of the largest nn.ModuleList (by parameters) whose members share one class."""
    best: Sequence[nn.Module] = ()
    best_size = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = list(module), size
    return best
