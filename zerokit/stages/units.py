"""Stage 3 splits the model into units: the modules whose parameters are gathered and freed together.

[Note: units and tied parameters]
A unit is a module whose parameters (less those of units inside it) are all-gathered right before it
runs and freed right after. The root module is always a unit: it owns every parameter no other unit
claims, and it stays gathered for the whole step. A parameter reachable from two units (an embedding
tied to the output head, say) cannot be gathered and freed with either one alone, so it is found by
identity and given to the root: tied weights need no grouping from the user.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from zerokit.config import Stage3Policy

CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass
class Unit:
    index: int  # 0 is the root
    module: nn.Module
    name: str
    param_ids: set[int] = field(default_factory=set)


def _is_unit(module: nn.Module, parent: nn.Module | None, policy: Stage3Policy) -> bool:
    if policy.unit_classes:
        return type(module).__name__ in policy.unit_classes
    # Auto-wrap: repeated blocks, i.e. members of a ModuleList/Sequential, large enough to be worth it.
    size = sum(p.numel() for p in module.parameters())
    return isinstance(parent, CONTAINERS) and size >= policy.min_unit_params


def find_units(model: nn.Module, policy: Stage3Policy) -> list[Unit]:
    """The root, then every unit in registration (pre-)order; units never nest."""
    units = [Unit(0, model, "<root>")]

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}{name}"
            if _is_unit(child, module, policy):
                units.append(Unit(len(units), child, qualified))
            else:
                visit(child, qualified + ".")

    visit(model, "")
    if policy.unit_classes and len(units) == 1:
        raise ValueError(f"stage3_unit_classes={list(policy.unit_classes)} matched no module of the model")
    _assign_parameters(units)
    return units


def _assign_parameters(units: list[Unit]) -> None:
    owners: dict[int, set[int]] = {}
    for unit in units[1:]:
        for param in unit.module.parameters():
            owners.setdefault(id(param), set()).add(unit.index)
    for param in units[0].module.parameters():
        claimed = owners.get(id(param), set())
        # See [Note: units and tied parameters]
        owner = next(iter(claimed)) if len(claimed) == 1 else 0
        units[owner].param_ids.add(id(param))
