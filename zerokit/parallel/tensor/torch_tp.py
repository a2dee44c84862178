"""A model parallelized by the user, with torch's `parallelize_module` (ColwiseParallel / RowwiseParallel on the
layout's tensor mesh) or by Hugging Face's `from_pretrained(..., tp_plan="auto", device_mesh=...)`, handed to
zerokit.initialize: each DTensor linear becomes the split linear of layers.py holding the same local piece as a
plain parameter.

[Note: the local piece of a DTensor is the parameter ZeRO shards]
ZeRO's flat buffers, buckets, masters and stage 3's gathers work on plain tensors: the DTensor wrapper's placements
would have to follow every view, gather and release. The piece a rank computes with is the DTensor's local tensor,
and what the DTensor layers do around it is fixed by their style: a column-wise linear (weight Shard(0)) reads a
replicated input and leaves its output sharded on the last dimension (or gathers it: output_layouts Replicate()); a
row-wise one (weight Shard(1)) reads that shard and all-reduces its partial output into a replicated one. Those are
exactly ColumnParallelLinear and RowParallelLinear, so the module is replaced by one holding the local piece, with
the same collectives over the layout's tensor group, and the style's hooks (torch) or forward (transformers) go with
the module they were on. Layouts other than these (sequence parallelism's Shard(1) activations, DTensor outputs kept
as DTensors, splits that are not even) are refused in one line naming the module, as is a DTensor parameter outside
a linear or an embedding.

[Note: an embedding the plan splits is held whole]
Hugging Face's plans split the token embedding by vocabulary (EmbeddingParallel, shard_dim 0), as torchtitan's does
with RowwiseParallel: each rank looks up its slice and the partial lookups are summed. zerokit gathers such an
embedding into a whole one on every tensor rank and takes the style's forward off, as DeepSpeed's AutoTP leaves
embeddings whole: the lookup needs no collective, and ZeRO still shards the whole embedding over the data group, at
t times a vocabulary split's share of it per rank (t: the tensor degree). The start-up log names each.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from zerokit.comm import Communicator
from zerokit.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

WHAT_IS_ACCEPTED = ("zerokit trains ColwiseParallel/RowwiseParallel linears whose activations are whole between "
                    "them (their default layouts; a column split may gather its output with output_layouts="
                    "Replicate()), and embeddings, which it holds whole")


def dtensor_types() -> tuple[type, type, type]:
    """torch's DTensor, Replicate and Shard, imported on first use: torch.distributed.tensor brings sympy, 0.46 s to
    import on every rank and about as long again to tear down when the process ends (measured: docs/reliability.md,
    "What it costs"); only a model parallelized with DTensors needs it, and its script imported it already."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    return DTensor, Replicate, Shard


def has_dtensors(model: nn.Module) -> bool:
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor exists before its module is imported
        return False
    dtensor = dtensor_types()[0]
    return any(isinstance(param, dtensor) for param in model.parameters())


class Adoption(NamedTuple):
    """A DTensor module of the model and what replaces it: "column" or "row" (a split linear; `gather`: whether a
    column split gathers its output), or "whole" (an embedding split by the plan, held whole on every tensor rank)."""
    name: str
    module: nn.Module
    how: str
    gather: bool


def planned_adoptions(model: nn.Module, tensor_group: list[int]) -> list[Adoption]:
    """Every DTensor linear and embedding of `model`, checked to be one zerokit computes over `tensor_group` (this
    rank's tensor ranks), before any group is made (See [Note: the plan is checked before any group is made] in
    autotp.py); a refusal leaves the model as it was."""
    plans, DTensor = [], dtensor_types()[0]
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(weight, DTensor):
            plans.append(Adoption(name, module, *_style(name, module, tensor_group)))
        elif isinstance(module, nn.Embedding) and isinstance(weight, DTensor):
            _check_mesh(name, weight, tensor_group)
            plans.append(Adoption(name, module, "whole", False))
    _refuse_shared(plans)
    adopted = {id(p) for plan in plans for p in plan.module.parameters(recurse=False)}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and id(param) not in adopted:
            raise ValueError(f"{name} is a DTensor outside a ColwiseParallel/RowwiseParallel linear or an embedding "
                             f"({_placements(param)}): ZeRO cannot shard it; {WHAT_IS_ACCEPTED}")
    return plans


def _refuse_shared(plans: list[Adoption]) -> None:
    """A DTensor parameter two planned modules share (an LM head tied to the embedding) would become two parameters,
    a split piece and a whole copy, trained apart: refused."""
    holder: dict[int, str] = {}
    for plan in plans:
        for param in plan.module.parameters(recurse=False):
            if id(param) in holder:
                raise ValueError(f"{plan.name} and {holder[id(param)]} share a parameter (tied weights) that the plan "
                                 "splits: zerokit would train a split piece and a whole copy apart; untie them "
                                 "(tie_word_embeddings=False) or leave the embedding and the head out of the plan")
            holder[id(param)] = plan.name


def adopt_dtensor_linears(model: nn.Module, plans: list[Adoption], comm: Communicator) -> dict[int, nn.Parameter]:
    """Replace each planned DTensor linear by the split linear holding its local piece (See [Note: the local piece
    of a DTensor is the parameter ZeRO shards]), and make each planned embedding whole (See [Note: an embedding the
    plan splits is held whole]); returns id(DTensor parameter) -> the parameter that replaced it."""
    replaced: dict[int, nn.Parameter] = {}
    for name, module, how, gather in plans:
        if how == "whole":
            replaced.update(_made_whole(module))
            continue
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


def _made_whole(module: nn.Module) -> dict[int, nn.Parameter]:
    """The module's DTensor parameters gathered into whole ones (a collective over their mesh: every tensor rank
    calls it, in the model's order), and the tensor-parallel forward its style installed taken off."""
    replaced, DTensor = {}, dtensor_types()[0]
    for attr, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            whole = nn.Parameter(param.full_tensor().detach(), requires_grad=param.requires_grad)
            setattr(module, attr, whole)
            replaced[id(param)] = whole
    module.__dict__.pop("forward", None)  # transformers' install_forward replaces the instance's forward
    for hooks in (module._forward_pre_hooks, module._forward_hooks):  # torch's distribute_module hooks
        for key in [key for key, hook in hooks.items() if _torch_style_call(hook)]:
            del hooks[key]
    return replaced


def _check_mesh(name: str, weight: DTensor, tensor_group: list[int]) -> None:
    mesh = weight.device_mesh
    if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != tensor_group:
        raise ValueError(f"{name} is split over the ranks {mesh.mesh.flatten().tolist()}, not this rank's tensor "
                         f"group {tensor_group}: parallelize the model on layout.device_mesh(...)['tensor']")


def _style(name: str, module: nn.Linear, tensor_group: list[int]) -> tuple[str, bool]:
    """("column" or "row", whether the output is gathered) of a DTensor linear, read from its weight's placement and
    the layouts its style was given (torch's hooks, or transformers' forward); refused where they are not the ones
    split linears compute, or where the split dimension does not divide evenly."""
    weight, (_, Replicate, Shard) = module.weight, dtensor_types()
    _check_mesh(name, weight, tensor_group)
    layouts = _style_layouts(module)
    placement = weight.placements[0]
    if isinstance(placement, Shard) and weight.shape[placement.dim] % len(tensor_group):
        raise ValueError(f"{name}: its {weight.shape[placement.dim]} {'outputs' if placement.dim == 0 else 'inputs'} "
                         f"do not split evenly over {len(tensor_group)} tensor ranks; zerokit splits evenly")
    if placement == Shard(0) and layouts.get("input") == (Replicate(),) and layouts.get("local"):
        if layouts.get("output") in ((Shard(-1),), (Replicate(),)):
            return "column", layouts["output"] == (Replicate(),)
    if placement == Shard(1) and layouts.get("input") == (Shard(-1),) and layouts.get("local") \
            and layouts.get("output") == (Replicate(),):
        return "row", False
    raise ValueError(f"{name}: a DTensor linear with weight {_placements(weight)} and layouts {layouts or 'unknown'}; "
                     f"{WHAT_IS_ACCEPTED}")


def _style_layouts(module: nn.Module) -> dict[str, Any]:
    """The input and output layouts (and use_local_output) the module's tensor-parallel style was given: the
    arguments of the partial functions torch's hooks call (torch/distributed/tensor/parallel/style.py,
    distribute_module in _api.py), or the attributes of the transformers style whose forward replaced the module's
    (transformers/distributed/tensor_parallel.py, install_forward)."""
    found: dict[str, Any] = {}
    for hook in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]:
        for call in _torch_style_call(hook):
            if call.func.__name__ == "_prepare_input_fn" and len(call.args) >= 1:
                found["input"] = tuple(call.args[0])
            if call.func.__name__ == "_prepare_output_fn" and len(call.args) >= 2:
                found["output"], found["local"] = tuple(call.args[0]), bool(call.args[1])
    forward = module.__dict__.get("forward")
    for cell in getattr(forward, "__closure__", None) or ():
        style = cell.cell_contents
        if all(hasattr(style, key) for key in ("input_layouts", "output_layouts", "use_local_output")):
            found.update(input=_as_tuple(style.input_layouts), output=_as_tuple(style.output_layouts),
                         local=bool(style.use_local_output))
    return found


def _torch_style_call(hook: Any) -> list[Any]:
    """The partial calls of torch's ParallelStyle a hook closes over (none: not one of torch's)."""
    calls = [cell.cell_contents for cell in getattr(hook, "__closure__", None) or ()]
    return [call for call in calls if getattr(getattr(call, "func", None), "__name__", "") in
            ("_prepare_input_fn", "_prepare_output_fn")]


def _as_tuple(layouts: Any) -> tuple:
    return tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,)


def _local_linear(module: nn.Linear) -> nn.Linear:
    """An nn.Linear of the local piece's shape holding the local tensors (the DTensors' own storage, detached)."""
    weight = module.weight.to_local().detach()
    local = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, device="meta")
    local.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        bias = module.bias.to_local() if isinstance(module.bias, dtensor_types()[0]) else module.bias
        local.bias = nn.Parameter(bias.detach(), requires_grad=module.bias.requires_grad)
    return local


def _placements(tensor: torch.Tensor) -> str:
    is_dtensor = isinstance(tensor, dtensor_types()[0])
    return "placements " + ", ".join(repr(p) for p in tensor.placements) if is_dtensor else "a tensor"
