"""Split experts named and placed as the model without expert parallelism holds them, for checkpoints (issue 45,
item 6).

[Note: split experts saved as the unsplit model's parameters]
A zerokit checkpoint is per parameter, not per rank: each rank file holds element ranges [begin, end) of flattened
parameters, by name, and a loader reads the ranges its own pieces need (See [Note: a checkpoint is per parameter, not
per rank] in zerokit/checkpoint/manifest.py). So split experts need no format of their own: each local expert's
parameters are saved under the name, shape and element range they have in the model without expert parallelism.
  - A Hugging Face experts module (SplitHFExperts) holds expert e's rows of the 3-D gate_up_proj [E, 2I, H] and
    down_proj [E, H, I]: its gate_up_proj is elements [e x 2I x H, (e + 1) x 2I x H) of `<block>.experts.gate_up_proj`.
  - DeepSpeed's MoE layer (ExpertParallelMoE) keeps a module per expert: local expert i is `<layer>.experts.<first +
    i>.<name>`, whole, as DeepSpeed names experts in its checkpoints by their global index.
Over the job every expert element is held by exactly one rank of its expert-data group at ZeRO 1-3 (one writer per
group at ZeRO 0), and the groups hold different experts, so the ranges of all rank files tile each whole parameter
once. A checkpoint of a split model is then the unsplit model's checkpoint: it loads at another expert degree (1
included), another stage and world size, with the model's own keys for a Hugging Face model, and consolidates to them.

[Note: split experts gathered whole]
What writes whole weights (engine.full_state_dict(), save_pretrained, the drop-in's 16-bit state dict) goes through
the unsplit model's parameters group by group. The split experts stand in it as parameters of their whole shape with
no memory (one element, expanded); each, in turn, is filled with its whole value: every rank of an expert group copies
its pieces to the CPU (one expert unit gathered at a time at ZeRO-3), the group all-gathers them, and the stand-in
holds the assembled tensor until the next is asked for. A rank then holds one whole expert parameter (a layer's experts
of one kind, for a Hugging Face model) beside its own experts' copies.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import nn

from zerokit.parallel.experts.hf import SplitHFExperts
from zerokit.parallel.experts.share import expert_layers


class WholePlace(NamedTuple):
    """Where a local expert's parameter sits in the unsplit model."""

    name: str  # the unsplit model's parameter name
    shape: tuple[int, ...]  # its whole shape
    offset: int  # the first element of this piece within it, flattened


def whole_places(model: nn.Module) -> dict[int, WholePlace]:
    """id of every split expert's parameter -> its place in the unsplit model (See [Note: split experts saved as the
    unsplit model's parameters])."""
    places: dict[int, WholePlace] = {}
    for path, layer in _split_layers(model):
        for index, expert in enumerate(layer.experts):
            number = layer.first_expert + index
            for name, param in expert.named_parameters():
                places[id(param)] = _place(path, layer, number, name, param)
    return places


def _place(path: str, layer: nn.Module, number: int, name: str, param: nn.Parameter) -> WholePlace:
    if isinstance(layer, SplitHFExperts):  # rows of one 3-D parameter, expert-major
        return WholePlace(_join(path, name), (layer.num_experts, *param.shape), number * param.numel())
    return WholePlace(_join(path, f"experts.{number}.{name}"), tuple(param.shape), 0)


def without_experts(model: nn.Module) -> nn.Module:
    """`model` as its dense stage holds it: shallow copies along the paths to the split experts, each split layer's
    `experts` container empty; every other module and tensor is the model's own."""
    paths = {_join(path, "experts") for path, _ in _split_layers(model)}
    return _replaced(model, "", {path: nn.ModuleList() for path in paths})


def unsplit_model(model: nn.Module) -> nn.Module:
    """The names and shapes of the model without expert parallelism, for a checkpoint's keys and checks: the dense
    modules are the model's own, the split experts stand in as meta tensors of their whole shapes (no memory)."""
    return _replaced(model, "", {path: _stand_in(layer) for path, layer in _split_layers(model)})


def _stand_in(layer: nn.Module) -> nn.Module:
    """The split layer as the unsplit model holds it, its experts' parameters of no storage (See [Note: split experts
    gathered whole])."""
    if isinstance(layer, SplitHFExperts):
        whole = nn.Module()
        for name, param in layer.experts[0].named_parameters():
            setattr(whole, name, nn.Parameter(_no_storage((layer.num_experts, *param.shape), param.dtype),
                                              requires_grad=param.requires_grad))
        return whole
    stand_in = copy.copy(layer)
    stand_in._modules = dict(layer._modules)
    stand_in._modules["experts"] = nn.ModuleList(_empty_copy(layer.experts[0]) for _ in range(layer.num_experts))
    return stand_in


def _empty_copy(expert: nn.Module) -> nn.Module:
    """A copy of `expert` whose parameters have its shapes and no storage."""
    copied = copy.copy(expert)
    copied._parameters = {name: None if param is None else nn.Parameter(_no_storage(tuple(param.shape), param.dtype),
                                                                         requires_grad=param.requires_grad)
                          for name, param in expert._parameters.items()}
    copied._modules = {name: None if child is None else _empty_copy(child) for name, child in expert._modules.items()}
    return copied


def _no_storage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` that holds one element (every index reads it): a stand-in's shape without its memory."""
    return torch.empty((), dtype=dtype).expand(shape)


def _replaced(module: nn.Module, prefix: str, replacements: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of `module` with the submodules at `replacements`' paths replaced (the copies made only along the
    way to them)."""
    if not replacements:
        return module
    if prefix in replacements:  # the model itself is the layer
        return replacements[prefix]
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    for name, child in module._modules.items():
        path = _join(prefix, name)
        if path in replacements:
            clone._modules[name] = replacements[path]
        elif child is not None and any(other.startswith(path + ".") for other in replacements):
            clone._modules[name] = _replaced(child, path, replacements)
    return clone


def _split_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    split = {id(layer) for layer in expert_layers(model)}
    return [(name, module) for name, module in model.named_modules() if id(module) in split]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
