"""Stage 3 splits the model into units: the modules whose parameters are gathered and freed together.

[Note: units and tied parameters]
A unit is a module whose parameters (less those of units inside it) are all-gathered right before it
runs and freed right after. The root module is always a unit: it owns every parameter no other unit
claims, and it stays gathered for the whole step. A parameter reachable from two units (an embedding
tied to the output head, say) cannot be gathered and freed with either one alone, so it is found by
identity and given to the root: tied weights need no grouping from the user. The one exception is a
parameter shared by units nested in one another, which the outermost of them owns: see
[Note: nested units].

[Note: small parameters stay with the root]
Parameters with fewer elements than stage3_param_persistence_threshold (norms, biases) are given to
the root unit whatever unit holds them, as DeepSpeed keeps such parameters unpartitioned: gathering
them with their unit would cost two collectives per unit per step for a few kilobytes. The root is
gathered once at the start of each step and stays gathered through forward and backward, so they are
replicated for the whole step and travel in one gather a step; their gradients and optimizer state
are sharded like any other. (A unit left with nothing is harmless: its hooks gather nothing.)

[Note: nested units]
Units named by the user (class names, classes or module instances) may nest: a transformer Block and
the attention inside it can both be units. Every named module becomes its own unit, and ownership
goes by who *holds* a parameter directly: a unit holds the parameters of its module and of submodules
that are not units themselves (the search stops at an inner unit). So the Block unit owns its norms
and MLP, the attention unit owns the attention's weights, and no parameter is in two units.
  - held by one unit: that unit owns it;
  - held by several units nested in one another (the Block's code and its attention both use one
    weight): the outermost owns it. It is gathered for the whole of the outer unit's forward, inside
    which the inner one runs, and its gradient is complete only once the inner unit's backward used it;
  - held by units that are not nested in one another (two sibling blocks, say): the root, as in
    [Note: units and tied parameters]. The root is around every unit, so a weight that the root's
    own code shares with a unit is the root's too.
The stage-3 hooks rely on one thing from the model: an inner unit's forward runs inside its outer
unit's forward, so the outer unit is gathered around it and, in backward, reached first (See
[Note: the stage-3 step] in hooks.py). Auto-wrap (no units named) never nests: it does not look
inside a unit it has made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from zerokit.config.typed import Stage3Policy

CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass
class Unit:
    index: int  # 0 is the root; a unit's index is larger than that of every unit around it (pre-order)
    module: nn.Module
    name: str
    param_ids: set[int] = field(default_factory=set)
    parent: int | None = None  # index of the innermost unit around this one (0: the root); None for the root


def find_units(model: nn.Module, policy: Stage3Policy, held_elsewhere: frozenset[int] = frozenset()) -> list[Unit]:
    """The root, then every unit in registration pre-order: an outer unit before the units inside it.
    Named units may nest (See [Note: nested units]); auto-wrapped ones never do. `held_elsewhere`: ids of parameters
    another stage holds (split MoE experts), which do not count towards auto-wrapping: a module of nothing else is
    no unit of this stage."""
    named = bool(policy.unit_classes or policy.units)
    if named:
        _check_every_name_matches(model, policy)
    units = [Unit(0, model, "<root>")]
    visited = {id(model)}

    def visit(module: nn.Module, prefix: str, around: int) -> None:
        for name, child in module.named_children():
            if id(child) in visited:  # a module registered twice is one module: the first path names it
                continue
            visited.add(id(child))
            qualified = f"{prefix}{name}"
            is_unit = _is_named(child, policy) if named else _is_auto_wrapped(child, module, policy, held_elsewhere)
            if is_unit:
                units.append(Unit(len(units), child, qualified, parent=around))
                if named:
                    visit(child, qualified + ".", units[-1].index)
            else:
                visit(child, qualified + ".", around)

    visit(model, "", 0)
    _assign_parameters(units)
    _keep_small_parameters_with_root(units, model, policy.persistence_threshold)
    return units


def _keep_small_parameters_with_root(units: list[Unit], model: nn.Module, threshold: int) -> None:
    """See [Note: small parameters stay with the root]."""
    small = {id(p) for p in model.parameters() if p.numel() < threshold}
    for unit in units[1:]:
        moved = unit.param_ids & small
        unit.param_ids -= moved
        units[0].param_ids |= moved


def ancestry(units: list[Unit], index: int) -> list[int]:
    """`index`, the unit around it, the one around that, ..., the root (0)."""
    chain = [index]
    while units[chain[-1]].parent is not None:
        chain.append(units[chain[-1]].parent)
    return chain


def _is_named(module: nn.Module, policy: Stage3Policy) -> bool:
    if type(module).__name__ in policy.unit_classes:
        return True
    return any(module is item if isinstance(item, nn.Module) else isinstance(module, item) for item in policy.units)


def _is_auto_wrapped(module: nn.Module, parent: nn.Module, policy: Stage3Policy, held_elsewhere: frozenset[int]
                     ) -> bool:
    # Repeated blocks, i.e. members of a ModuleList/Sequential, large enough to be worth it.
    size = sum(p.numel() for p in module.parameters() if id(p) not in held_elsewhere)
    return isinstance(parent, CONTAINERS) and size >= policy.min_unit_params


def _check_every_name_matches(model: nn.Module, policy: Stage3Policy) -> None:
    """A misspelt class name or a module of another model would silently leave its part to the root."""
    modules = list(model.modules())
    class_names = {type(module).__name__ for module in modules}
    unmatched = [_describe(name) for name in policy.unit_classes if name not in class_names]
    for item in policy.units:
        matches = any(m is item for m in modules) if isinstance(item, nn.Module) else any(
            isinstance(m, item) for m in modules)
        if not matches:
            unmatched.append(_describe(item))
    if unmatched:
        given = [_describe(item) for item in (*policy.unit_classes, *policy.units)]
        raise ValueError(f"stage3 units {', '.join(unmatched)} matched no module of the model (given: "
                         f"{', '.join(given)}); name a class the model uses, or pass its classes or submodules")


def _describe(item: str | type | nn.Module) -> str:
    if isinstance(item, str):
        return repr(item)
    if isinstance(item, nn.Module):
        return f"<{type(item).__name__} instance>"
    return f"<class {item.__qualname__}>"


def _assign_parameters(units: list[Unit]) -> None:
    """See [Note: nested units] and [Note: units and tied parameters]."""
    unit_modules = {id(unit.module) for unit in units[1:]}
    holders: dict[int, list[int]] = {}  # parameter id -> the units that hold it directly, in index order
    for unit in units:
        for param_id in _held_directly(unit.module, unit_modules):
            holders.setdefault(param_id, []).append(unit.index)
    for param_id, held_by in holders.items():
        units[_owner(units, held_by)].param_ids.add(param_id)


def _held_directly(module: nn.Module, unit_modules: set[int]) -> set[int]:
    """Ids of the parameters of `module` and of its submodules, not looking inside other units."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.update(id(param) for param in current.parameters(recurse=False))
        stack.extend(child for child in current.children() if id(child) not in unit_modules)
    return found


def _owner(units: list[Unit], held_by: list[int]) -> int:
    """One holder owns it; holders nested in one another: the outermost; otherwise the root."""
    if len(held_by) == 1:
        return held_by[0]
    # Units around a unit have smaller indices, so if the holders nest, the largest is the innermost and
    # its ancestry holds them all.
    if set(ancestry(units, max(held_by))).issuperset(held_by):
        return min(held_by)
    return 0
