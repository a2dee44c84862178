"""Hugging Face MoE models with their experts split over ranks (issue 45, item 5), as DeepSpeed's AutoEP config asks:
`"expert_parallel": {"enabled": true, "autoep_size": ep}`.

[Note: a Hugging Face MoE block split over an expert group]
transformers 5 holds a MoE layer's experts as one module of two 3-D parameters, gate_up_proj [E, 2I, H] and
down_proj [E, H, I] (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 share the class body), which the block calls
as experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) after its own router. DeepSpeed's AutoEP replaces
the whole block with a router and experts of its own; zerokit replaces the experts module alone, by SplitHFExperts.
The block, its router (dense, the same on every rank), its auxiliary loss and any shared expert stay the model's, so
the routes are the model's and the run it must equal is the model's own under DDP. Each rank of an expert group of
ep ranks keeps E / ep experts in DeepSpeed's order (expert e on the group's rank e // (E / ep)), each a module of its
own with its slices ([2I, H] and [H, I]); the tokens travel as dispatch.py's dropless exchange sends them, each expert
computes what the model's loop computes for it (the same two linears on the same rows), and a token's k outputs are
weighed and summed as the model sums them (in another order, which for k = 2 is the same sum). The experts then are
split experts like ExpertParallelMoE's: a ZeRO stage of their own over their expert-data group (See [Note: ZeRO over
experts split across ranks] in share.py), each local expert a unit at ZeRO-3, and every local expert runs at every
forward, on no rows if none came, so an idle expert hangs nothing.
The split happens as the engine is built, before the optimizer's groups are read, and the optimizer's and
model_parameters' 3-D parameters are pointed at this rank's pieces, as AutoTP's split is remapped (parallel/remap.py).
A route to index E (transformers' "no expert", the extra class of its one-hot) goes nowhere, as the model's loop
skips it. GPT-OSS's experts (biases, a clamped activation, transposed weights) have another body: refused in one line.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerokit.config.settings import TensorSettings
from zerokit.parallel.experts.dispatch import dropless, group_size
from zerokit.parallel.mesh import Layout
from zerokit.parallel.remap import Replacements, refuse_stepped_state, remap_parameters


class HFExpert(nn.Module):
    """One expert of a transformers experts module: its rows of gate_up_proj and down_proj, run as the module's loop
    runs an expert."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor],
                 requires_grad: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up.detach().clone(), requires_grad=requires_grad)
        self.down_proj = nn.Parameter(down.detach().clone(), requires_grad=requires_grad)
        self.act_fn = act_fn

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj)


class SplitHFExperts(nn.Module):
    """A transformers experts module's E experts split over an expert group of `ep` ranks: this rank's E / ep of them,
    the ones at `place` in the group, called as the module was (See [Note: a Hugging Face MoE block split over an
    expert group]). The group is set by the engine (set_group), as ExpertParallelMoE's is."""

    def __init__(self, whole: nn.Module, ep: int, place: int) -> None:
        super().__init__()
        self.num_experts, self.ep, self.group = whole.num_experts, ep, None
        self.num_local_experts = self.num_experts // ep
        self.first_expert = place * self.num_local_experts
        mine = range(self.first_expert, self.first_expert + self.num_local_experts)
        trains = whole.gate_up_proj.requires_grad
        self.experts = nn.ModuleList(HFExpert(whole.gate_up_proj[e], whole.down_proj[e], whole.act_fn, trains)
                                     for e in mine)

    def set_group(self, group: Any) -> None:
        if group_size(group) != self.ep:
            raise ValueError(f"an expert group of {group_size(group)} ranks was given to experts split over {self.ep}")
        self.group = group

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            raise RuntimeError(f"these experts are split over {self.ep} ranks but have no expert group yet: wrap the "
                               "model with zerokit.initialize (or deepspeed.initialize) first")
        routes = top_k_index.t()  # [k, T]: route j * T + t is token t's j-th choice, as dropless reads them
        routes = routes.masked_fill(routes >= self.num_experts, -1)
        routed = dropless(hidden_states, routes, self.num_experts, self.group, self.experts)
        return (routed * top_k_weights.t().unsqueeze(-1)).sum(0).to(hidden_states.dtype)


def split_hf_experts(model: nn.Module, layout: Layout | None, part: TensorSettings, optimizer: Any,
                     model_parameters: Any) -> tuple[Any, Any]:
    """Where the config's expert_parallel block gives the layout its expert degree: every transformers experts module
    of `model` replaced by this rank's SplitHFExperts, and `optimizer` and `model_parameters` pointed at its pieces;
    everything as it is otherwise."""
    if layout is None or part.expert_parallel_size == 1:
        return optimizer, model_parameters
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if is_hf_experts(child)]
    if not found:
        raise ValueError(f"expert_parallel.autoep_size={layout.expert}, but {type(model).__name__} has no transformers "
                         "MoE experts module (gate_up_proj [experts, 2 x intermediate, hidden] and down_proj) to split")
    rank = dist.get_rank()
    place = layout.group_of(layout.expert_groups(), rank).index(rank)
    refuse_stepped_state(optimizer, {id(p) for _, _, whole in found for p in whole.parameters()},
                         "expert parallelism splits")
    replaced: Replacements = {}
    for parent, name, whole in found:
        _check_splittable(whole, layout.expert)
        split = SplitHFExperts(whole, layout.expert, place)
        setattr(parent, name, split)
        replaced[id(whole.gate_up_proj)] = [expert.gate_up_proj for expert in split.experts]
        replaced[id(whole.down_proj)] = [expert.down_proj for expert in split.experts]
    _refuse_used_elsewhere(model, replaced)
    return remap_parameters(optimizer, model_parameters, replaced)


def _refuse_used_elsewhere(model: nn.Module, replaced: Replacements) -> None:
    """A whole experts parameter still reachable after the split is used outside its experts module (tied to another
    layer): that use would train the old tensor alone."""
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in replaced:
            raise ValueError(f"{name} is an MoE experts parameter used outside its experts module too; expert "
                             "parallelism splits experts that are their module's alone (give the other use a "
                             "parameter of its own, or train without expert_parallel)")


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module: 3-D gate_up_proj and down_proj, one row per expert."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and hasattr(module, "num_experts"))


def _check_splittable(whole: nn.Module, ep: int) -> None:
    experts, twice_inner, hidden = whole.gate_up_proj.shape
    if (whole.down_proj.shape != (experts, hidden, twice_inner // 2) or hasattr(whole, "gate_up_proj_bias")
            or not hasattr(whole, "act_fn")):
        raise ValueError(f"{type(whole).__name__}'s experts are not the Mixtral/Qwen-MoE layout (gate_up_proj [E, 2I, "
                         "H], down_proj [E, H, I], no biases) that zerokit splits over ranks; train it without "
                         "expert_parallel (every rank holds every expert, at any ZeRO stage)")
    if experts % ep:
        raise ValueError(f"{type(whole).__name__} has {experts} experts, which do not split over "
                         f"expert_parallel.autoep_size={ep} ranks; use a divisor of {experts}")
    if whole.gate_up_proj.device.type == "meta":
        raise ValueError(f"{type(whole).__name__}'s experts are on the meta device; expert parallelism splits "
                         "experts that hold their values (build the model on the CPU)")
