"""Agreement at start: before its first collective on the model, `initialize` checks that every rank is about to
train the same thing, and names what differs.

[Note: the start-up fingerprint]
Ranks that disagree (another ZeRO stage, one extra layer, another accumulation, precision, unit policy or
learning rate on one rank) issue different collectives, or the same ones with different meanings: the job
hangs or, worse, trains a different model on each rank. So each rank describes what it is about to train as
ordered fields, name -> value:
  - versions: zerokit, torch, Python; the device type; whether the model is built on the meta device;
  - the resolved config, every field (its typed form: what the engine acts on, "auto" resolved);
  - every parameter: name, shape, dtype, requires_grad and the optimizer and param group it is in (the layout
    follows from these, in this order, and the config's bucket size: one zerokit version lays them out alike),
    a tied parameter's other names; every buffer's name, shape and dtype;
  - stage 3's units (name and size), found as the stage will find them;
  - every optimizer: its class and each param group's hyperparameters (lr, betas, weight_decay, ...).
The fields are hashed (SHA-256) and the digests compared in one all-reduce of 8 int64 on the control group,
once. Only when they differ do the ranks gather their fields (two more collectives, on the way to an error)
and every rank raises the same line, naming the first field that differs and which ranks hold which value.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from zerokit.comm import Communicator
from zerokit.comm.agreement import all_gather_bytes, min_max

PURPOSE = "start-up fingerprint"
SHOWN_CHARS = 160  # of a value, in the error line


class RanksDisagreeError(RuntimeError):
    """The ranks were given different versions, configs, models or optimizers."""


Fields = dict[str, str]


def fingerprint(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], agreed: Sequence[tuple[str, Any]],
                stage: int, units: Any, device: torch.device) -> Fields:
    """This rank's fields, in order (See [Note: the start-up fingerprint]). `agreed`: the config's compared fields,
    flattened (config/settings.py's SafeguardSettings.agreed); `units`: config/typed.py's Stage3Policy, read at
    stage 3."""
    import zerokit

    fields: Fields = {"zerokit version": zerokit.__version__, "torch version": torch.__version__,
                      "python version": platform.python_version(), "device type": device.type,
                      "built on the meta device": str(any(p.is_meta for p in model.parameters()))}
    fields.update(_config_fields(agreed, model))
    fields.update(_parameter_fields(model, optimizers))
    fields.update({f"buffer {name}": _tensor(b) for name, b in model.named_buffers()})
    fields.update(_unit_fields(model, stage, units))
    fields.update(_optimizer_fields(optimizers))
    return fields


def check_ranks_agree(fields: Fields, control: Communicator) -> None:
    """Raise RanksDisagreeError on every rank unless every rank's fields are identical."""
    if control.world_size == 1:
        return
    encoded = json.dumps(list(fields.items())).encode()
    digest = hashlib.sha256(encoded).digest()
    keys = [int.from_bytes(digest[i:i + 8], "little") >> 2 for i in range(0, 32, 8)]  # 62 bits each
    smallest, largest = min_max(control, keys, purpose=PURPOSE)
    if smallest == largest:
        return
    every = [dict(json.loads(data)) for data in all_gather_bytes(control, encoded, purpose=PURPOSE)]
    raise RanksDisagreeError(first_difference(every))


def first_difference(every: list[Fields]) -> str:
    """One line: the first field (in the order the ranks list them) whose value is not the same on every rank,
    and which ranks hold which value."""
    position: dict[str, int] = {}
    for fields in every:
        for index, name in enumerate(fields):
            position[name] = min(position.get(name, index), index)
    differing = [name for name in sorted(position, key=position.__getitem__)
                 if len({fields.get(name) for fields in every}) > 1]
    name = differing[0]
    holders: dict[str, list[int]] = {}
    for rank, fields in enumerate(every):
        holders.setdefault(fields.get(name, "<absent>"), []).append(rank)
    held = "; ".join(f"{_ranks(ranks)}: {_shown(value)}" for value, ranks in holders.items())
    more = f" ({len(differing) - 1} more field(s) differ)" if len(differing) > 1 else ""
    return (f"zerokit.initialize: the ranks disagree on {name}: {held}{more}; every rank must run the same zerokit "
            "and torch, config, model and optimizer hyperparameters")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _shown(value: str) -> str:
    return repr(value if len(value) <= SHOWN_CHARS else value[:SHOWN_CHARS] + "...")


# --- the fields --------------------------------------------------------------------------------------
def _config_fields(agreed: Sequence[tuple[str, Any]], model: nn.Module) -> Fields:
    """The config's compared fields (dotted name, value), each value rendered."""
    names = {id(module): name or "<root>" for name, module in model.named_modules()}
    return {name: _render(value, names) for name, value in agreed}


def _render(value: Any, names: dict[int, str]) -> str:
    """A value as a string that is the same on every rank for the same meaning (no ids, no addresses)."""
    if isinstance(value, nn.Module):
        return f"<module {names.get(id(value), type(value).__qualname__)}>"
    if isinstance(value, type):
        return f"<class {value.__module__}.{value.__qualname__}>"
    if isinstance(value, torch.Tensor):
        return repr(value.tolist())
    if isinstance(value, Mapping):
        return "{" + ", ".join(sorted(f"{_render(k, names)}: {_render(v, names)}" for k, v in value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_render(item, names) for item in value) + ")"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))  # a function's or object's address differs per rank


def _tensor(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _parameter_fields(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Fields:
    where = {id(p): f"optimizer {i} group {j}" for i, o in enumerate(optimizers)
             for j, group in enumerate(o.param_groups) for p in group["params"]}
    first: dict[int, str] = {}
    fields: Fields = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            fields[f"parameter {name}"] = f"tied to {first[id(param)]}"
            continue
        first[id(param)] = name
        fields[f"parameter {name}"] = (f"{_tensor(param)} requires_grad={param.requires_grad} "
                                       f"{where.get(id(param), 'in no optimizer')}")
    return fields


def _unit_fields(model: nn.Module, stage: int, units: Any) -> Fields:
    if stage != 3:
        return {}
    from zerokit.stages.units import find_units

    try:
        found = find_units(model, units)
    except ValueError as error:  # raised again by the stage, once the ranks agree that it is everyone's error
        return {"stage-3 units": f"error: {error}"}
    sizes = {id(p): p.numel() for p in model.parameters()}
    return {f"stage-3 unit {unit.index}": f"{unit.name} ({sum(sizes[i] for i in unit.param_ids):,} elements)"
            for unit in found}


def _optimizer_fields(optimizers: Sequence[torch.optim.Optimizer]) -> Fields:
    fields: Fields = {}
    for i, optimizer in enumerate(optimizers):
        cls = type(optimizer)
        fields[f"optimizer {i}"] = f"{cls.__module__}.{cls.__qualname__}, {len(optimizer.param_groups)} param group(s)"
        for j, group in enumerate(optimizer.param_groups):
            fields[f"optimizer {i} group {j} size"] = f"{len(group['params'])} parameters"
            for key in sorted(k for k in group if k != "params"):
                fields[f"optimizer {i} group {j} {key}"] = _render(group[key], {})
    return fields
