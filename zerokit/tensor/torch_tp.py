"""A model parallelized by the user with torch's `parallelize_module` (ColwiseParallel / RowwiseParallel on the
layout's tensor mesh), handed to zerokit.initialize: each DTensor linear becomes the split linear of layers.py
holding the same local piece as a plain parameter.

[Note: the local piece of a DTensor is the parameter ZeRO shards]
ZeRO's flat buffers, buckets, masters and stage 3's gathers work on plain tensors: the DTensor wrapper's placements
would have to follow every view, gather and release. The piece a rank computes with is the DTensor's local tensor,
and what the DTensor layers do around it is fixed by their style: a column-wise linear (weight Shard(0)) reads a
replicated input and leaves its output sharded on the last dimension (or gathers it: output_layouts Replicate()); a
row-wise one (weight Shard(1)) reads that shard and all-reduces its partial output into a replicated one. Those are
exactly ColumnParallelLinear and RowParallelLinear, so the module is replaced by one holding the local piece, with
the same collectives over the layout's tensor group, and torch's hooks go with the module they were on. Layouts
other than these (sequence parallelism's Shard(1) activations, a vocabulary-split embedding, DTensor outputs kept as
DTensors) are refused in one line naming the module, as is a DTensor parameter outside such a linear.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from zerokit.comm import Communicator
from zerokit.tensor.layers import ColumnParallelLinear, RowParallelLinear

WHAT_IS_ACCEPTED = ("zerokit trains ColwiseParallel/RowwiseParallel linears whose activations are whole between "
                    "them (their default layouts; a column split may gather its output with output_layouts="
                    "Replicate())")


def has_dtensors(model: nn.Module) -> bool:
    return any(isinstance(param, DTensor) for param in model.parameters())


def adopt_dtensor_linears(model: nn.Module, comm: Communicator) -> dict[int, nn.Parameter]:
    """Replace every DTensor linear of `model` by the split linear holding its local piece (See [Note: the local
    piece of a DTensor is the parameter ZeRO shards]); returns id(DTensor parameter) -> the piece that replaced it.
    Checks everything first, so a refusal leaves the model as it was."""
    plans = [(name, module, _style(name, module, comm)) for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and isinstance(module.weight, DTensor)]
    adopted = {id(p) for _, module, _ in plans for p in module.parameters(recurse=False)}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and id(param) not in adopted:
            raise ValueError(f"{name} is a DTensor outside a ColwiseParallel/RowwiseParallel linear "
                             f"({_placements(param)}): ZeRO cannot shard it; {WHAT_IS_ACCEPTED}")
    replaced: dict[int, nn.Parameter] = {}
    for name, module, (how, gather) in plans:
        local = _local_linear(module)
        split = ColumnParallelLinear.from_piece(local, comm, gather) if how == "column" \
            else RowParallelLinear.from_piece(local, comm)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, split)
        for attr in ("weight", "bias"):
            old, new = getattr(module, attr), getattr(split, attr)
            if old is not None:
                replaced[id(old)] = new
    return replaced


def _style(name: str, module: nn.Linear, comm: Communicator) -> tuple[str, bool]:
    """("column" or "row", whether the output is gathered) of a DTensor linear, read from its weight's placement and
    the layouts torch's hooks were given; refused where they are not the ones split linears compute."""
    weight = module.weight
    mesh = weight.device_mesh
    group = next(ranks for ranks in comm.siblings if dist.get_rank() in ranks)
    if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != group:
        raise ValueError(f"{name} is split over the ranks {mesh.mesh.flatten().tolist()}, not this rank's tensor "
                         f"group {group}: parallelize the model on layout.device_mesh(...)['tensor']")
    layouts = _hook_layouts(module)
    placement = weight.placements[0]
    if placement == Shard(0) and layouts.get("input") == (Replicate(),) and layouts.get("local"):
        if layouts.get("output") in ((Shard(-1),), (Replicate(),)):
            return "column", layouts["output"] == (Replicate(),)
    if placement == Shard(1) and layouts.get("input") == (Shard(-1),) and layouts.get("local") \
            and layouts.get("output") == (Replicate(),):
        return "row", False
    raise ValueError(f"{name}: a DTensor linear with weight {_placements(weight)} and layouts {layouts or 'unknown'}; "
                     f"{WHAT_IS_ACCEPTED}")


def _hook_layouts(module: nn.Module) -> dict[str, Any]:
    """The input and output layouts (and use_local_output) torch's ParallelStyle gave the module's hooks: the
    arguments of the partial functions its hooks call (torch/distributed/tensor/parallel/style.py, distribute_module
    in _api.py)."""
    found: dict[str, Any] = {}
    for hook in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]:
        for cell in getattr(hook, "__closure__", None) or ():
            call = cell.cell_contents
            name = getattr(getattr(call, "func", None), "__name__", "")
            if name == "_prepare_input_fn" and len(call.args) >= 1:
                found["input"] = tuple(call.args[0])
            if name == "_prepare_output_fn" and len(call.args) >= 2:
                found["output"], found["local"] = tuple(call.args[0]), bool(call.args[1])
    return found


def _local_linear(module: nn.Linear) -> nn.Linear:
    """An nn.Linear of the local piece's shape holding the local tensors (the DTensors' own storage, detached)."""
    weight = module.weight.to_local().detach()
    local = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, device="meta")
    local.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        bias = module.bias.to_local() if isinstance(module.bias, DTensor) else module.bias
        local.bias = nn.Parameter(bias.detach(), requires_grad=module.bias.requires_grad)
    return local


def _placements(tensor: torch.Tensor) -> str:
    return "placements " + ", ".join(repr(p) for p in tensor.placements) if isinstance(tensor, DTensor) else "a tensor"
