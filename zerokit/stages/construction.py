"""Sharded construction: a model built on the meta device is materialised one unit at a time, so no
rank ever holds the whole model.

[Note: sharded construction]
Build the model under `torch.device("meta")` (shapes only, no memory) and the optimizer over its
parameters, then call `zerokit.initialize(..., param_init=fn)` at stage 3. zerokit swaps each meta
parameter for a real one that holds no memory (one NaN broadcast to its shape: see
the module docstring of flat/sharded.py), keeping ties and the optimizer's param groups. Then, unit by
unit, it gives the unit's parameters real storage, calls `param_init(module)` on each module that
owns them (default: the module's own `reset_parameters()`), keeps this rank's shard and fp32 master
(frozen parameters: the shard only), and frees the rest. Ranks must initialise identically (seed them
the same, or load the same file): a checksum of every unit is compared across ranks; a difference raises.

Loading pretrained weights, streaming: `param_init=zerokit.safetensors_init(model, "model.safetensors")`
reads each module's tensors from the (memory-mapped) file as its unit is built, so peak host memory is
one unit in fp32, plus what safetensors maps. A tied weight saved under one of its names only (as
Hugging Face saves an LM head tied to the embedding) is found under that name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from zerokit.comm import Communicator

ParamInit = Callable[[nn.Module], None]


def reset_parameters(module: nn.Module) -> None:
    """The default param_init: the module's own reset_parameters(), as torch layers define it."""
    if not hasattr(module, "reset_parameters"):
        raise ValueError(f"{type(module).__name__} was built on the meta device and has no reset_parameters(); "
                         "pass param_init=fn to zerokit.initialize to initialise or load its parameters and buffers")
    module.reset_parameters()


@dataclass
class Construction:
    """What stage 3 still has to build of a model that came from the meta device."""

    pending: set[int] = field(default_factory=set)
    """ids of parameters that still need `param_init` (they hold no memory yet)."""
    param_init: ParamInit = reset_parameters
    verify: bool = False
    """Compare a checksum of every unit across ranks once it is built (ranks must initialise alike)."""


def has_meta_parameters(model: nn.Module) -> bool:
    return any(param.is_meta for param in model.parameters())


def replace_meta_parameters(model: nn.Module, optimizers: list[torch.optim.Optimizer],
                            device: torch.device) -> tuple[set[int], list[nn.Module]]:
    """Swap meta parameters for memory-less real ones (ties and optimizer groups kept) and meta buffers
    for uninitialised real ones. Returns the ids of the new parameters, which need `param_init` when
    their unit is materialised, and the modules that own new buffers but no parameters, which need it
    on their own (See init_buffer_owners)."""
    replacement: dict[int, nn.Parameter] = {}
    buffer_owners: list[nn.Module] = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in replacement:
                nothing = torch.full((1,), float("nan"), dtype=param.dtype, device=device)
                replacement[id(param)] = nn.Parameter(nothing.expand(param.shape), requires_grad=param.requires_grad)
            module._parameters[name] = replacement[id(param)]
        meta_buffers = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        for name in meta_buffers:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)  # param_init fills it
        if meta_buffers and not module._parameters:
            buffer_owners.append(module)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [replacement.get(id(p), p) for p in group["params"]]
    return {id(p) for p in replacement.values()}, buffer_owners


def init_buffer_owners(owners: list[nn.Module], param_init: ParamInit) -> None:
    """Modules that own buffers but no parameters (a rotary embedding's inv_freq, say) are part of no
    unit's initialisation, so `param_init` runs on them once, before any unit: their buffers came from
    the meta device as uninitialised memory."""
    with torch.no_grad():
        for module in owners:
            param_init(module)


def place_model(model: nn.Module, optimizers: list[torch.optim.Optimizer], param_init: ParamInit | None,
                stage: int, device: torch.device, comm: Communicator,
                experts: tuple[frozenset[int], Communicator] | None = None) -> Construction | None:
    """Move the model to this rank's device. A model built on the meta device is left for stage 3 to
    materialise unit by unit (See [Note: sharded construction]); any other starts from rank 0's
    weights and buffers, as torch DDP does, and `experts` (the ids of MoE experts' parameters split over ranks, and
    their expert-data group) from their group's first rank's."""
    if has_meta_parameters(model):
        if stage != 3:
            raise ValueError(f"a model on the meta device needs zero_optimization.stage=3 (got {stage}): only stage 3 "
                             "never holds the whole model")
        pending, buffer_owners = replace_meta_parameters(model, optimizers, device)
        init_buffer_owners(buffer_owners, param_init or reset_parameters)
        model.to(device=device)
        return Construction(pending, param_init or reset_parameters, verify=True)
    if param_init is not None:
        raise ValueError("param_init is for models built on the meta device; this model has real parameters")
    model.to(device=device)
    expert_ids, expert_comm = experts if experts is not None else (frozenset(), comm)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            over = expert_comm if id(tensor) in expert_ids else comm
            over.broadcast(tensor.data, src=0, purpose=f"rank 0's {name}")
    return None


def materialise(model: nn.Module, param_ids: set[int], construction: Construction) -> None:
    """Give the parameters in `param_ids` that are still pending real storage, then run `param_init` on
    every module that owns one of them (in model order, as a normal init would)."""
    todo = param_ids & construction.pending
    if not todo:
        return
    owners = []
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) in todo]
        if own:
            owners.append(module)
        for param in own:  # a tied parameter is met twice; allocating twice before any init is harmless
            param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        for module in owners:
            construction.param_init(module)
    construction.pending -= todo


def safetensors_init(model: nn.Module, path: str | Path) -> ParamInit:
    """A `param_init` that fills each module's parameters and buffers from a safetensors file, tensor by
    tensor, as zerokit materialises the module's unit (See [Note: sharded construction])."""
    from safetensors import safe_open  # a dependency of zerokit, imported when used

    weights = safe_open(str(path), framework="pt")
    stored = set(weights.keys())
    names: dict[int, list[str]] = {}  # every name of a tensor (tied parameters have several), by id

    def load(module: nn.Module) -> None:
        if not names:  # built at the first call: initialize() has replaced the meta tensors by then
            for name, tensor in [*model.named_parameters(remove_duplicate=False),
                                 *model.named_buffers(remove_duplicate=False)]:
                names.setdefault(id(tensor), []).append(name)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            key = next((name for name in names[id(tensor)] if name in stored), None)
            if key is None:
                raise ValueError(f"{path} holds no tensor named {' or '.join(map(repr, names[id(tensor)]))}; "
                                 "it must hold every parameter and buffer of the model under its state-dict name")
            tensor.data.copy_(weights.get_tensor(key))

    return load
