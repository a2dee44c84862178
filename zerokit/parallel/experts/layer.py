"""ExpertParallelMoE: DeepSpeed's MoE layer (deepspeed/moe/layer.py MoE, sharded_moe.py MOELayer, experts.py
Experts, 0.19.8) over an expert group: the same gate (gate.py), the same experts (deep copies of one module), the same
residual form, and the same return, (output, l_aux, exp_counts), so that a DeepSpeed MoE script computes the same
losses. Tokens travel as dispatch.py describes ([Note: the expert exchange]).

Where tokens may be dropped, the outputs and gradients are DeepSpeed's bit for bit (the same slot buffer, and each
expert called on DeepSpeed's [ep, 1, C, hidden] slice of it). Dropless, each expert is called on exactly its rows,
[n, hidden], where DeepSpeed pads every expert to the largest count in the group: the same values up to the order
of the experts' sums (a few ulps), and an expert that draws random numbers (dropout) draws them for other shapes.
Where tokens may be dropped, every forward also all-reduces two integers over the group to check that its ranks have
the same capacity (the same token count): DeepSpeed does not, and on gloo its ranks abort inside the all-to-all
("Received data size doesn't match expected size") when their token counts differ.

The layer's group may come later (`ep_size` without `group`): zerokit's engine gives each layer of a model it wraps
the expert group of its mesh, as DeepSpeed's engine does (set_deepspeed_parallelism), and shards and averages the
experts' states over their expert-data group (zerokit/parallel/experts/share.py).

What is not here: DeepSpeed's tensor-parallel experts and its drop of duplicate tokens over a tensor group, and Tutel.
The parameters are not marked as DeepSpeed marks them (`allreduce = False`, `group_name`) for its engine.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerokit.parallel.experts.dispatch import (combine, dropless, exchange_slots, expert_output, group_size,
                                               pack_slots, slot_indices, unpack_slots)
from zerokit.parallel.experts.gate import NOISY_GATE_POLICIES, Gate, GateSettings, Routes


class ExpertParallelMoE(nn.Module):
    """A mixture of `num_experts` copies of `expert` (each [.., hidden] -> [.., hidden]), E / ep of them on each rank
    of `group` (a process group of ep ranks, or None for one process holding all), expert e on the group's rank
    e // (E / ep). Arguments as DeepSpeed's MoE (ep_size is the group's size; given without a group, the group is
    set later: set_group). The parameters are created in DeepSpeed's order (the experts copied, then the gate, then the
    residual coefficient), so a seeded model starts from DeepSpeed's weights."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, group: Any = None, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 drop_tokens: bool = True, use_residual: bool = False, noisy_gate_policy: str | None = None,
                 use_rts: bool = True, top2_2nd_expert_sampling: bool = True, ep_size: int | None = None) -> None:
        super().__init__()
        self.group, self.ep = group, group_size(group) if group is not None else (ep_size or 1)
        if ep_size is not None and ep_size != self.ep:
            raise ValueError(f"ep_size={ep_size} differs from the {self.ep} ranks of the group given; give one of them")
        _check(num_experts, self.ep, k, noisy_gate_policy)
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.ep
        self.experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(self.num_local_experts))
        settings = GateSettings(k=k, capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
                                min_capacity=min_capacity, drop_tokens=drop_tokens, noisy_gate_policy=noisy_gate_policy,
                                use_rts=use_rts, top2_2nd_expert_sampling=top2_2nd_expert_sampling)
        self.gate = Gate(hidden_size, num_experts, settings)
        self.use_residual = use_residual
        if use_residual:  # DeepSpeed's residual MoE: the expert module itself (not a copy) beside the mixture
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first local expert."""
        return (dist.get_rank(self.group) if self.ep > 1 else 0) * self.num_local_experts

    def set_group(self, group: Any) -> None:
        """The expert group of `ep` ranks this layer exchanges tokens over (zerokit's engine sets it from its mesh)."""
        if group_size(group) != self.ep:
            raise ValueError(f"an expert group of {group_size(group)} ranks was given to a layer split over {self.ep}")
        self.group = group

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output shaped as hidden_states, this rank's l_aux, this rank's choices per expert) as DeepSpeed's MoE."""
        if self.group is None and self.ep > 1:
            raise RuntimeError(f"this MoE layer splits its experts over {self.ep} ranks but has no expert group yet: "
                               "wrap the model with zerokit.initialize (or deepspeed.initialize) first, or pass group=")
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        routes = self.gate(tokens, used_token)
        if routes.capacity is None:
            routed = self._dropless(tokens, routes)
        else:
            routed = self._through_slots(tokens, routes)
        output = combine(routed, routes.weights, tokens.dtype).reshape(hidden_states.shape)
        if self.use_residual:
            output = self._with_residual(hidden_states, output)
        return output, routes.l_aux, routes.exp_counts

    def _through_slots(self, tokens: torch.Tensor, routes: Routes) -> torch.Tensor:
        """The routes' expert outputs, [k, S, M], through DeepSpeed's [E, C, M] buffer."""
        capacity = self._same_capacity(routes.capacity, tokens.device)
        slots = slot_indices(routes.experts, routes.locations, self.num_experts, capacity)
        received = exchange_slots(pack_slots(tokens, slots, self.num_experts, capacity), self.group)
        # [ep, E / ep, C, M]; each expert gets DeepSpeed's [ep, 1, C, M] slice, the slots every source sent it
        received = received.view(self.ep, self.num_local_experts, capacity, tokens.shape[-1])
        outputs = [expert_output(expert(part)) for part, expert in zip(received.chunk(self.num_local_experts, dim=1),
                                                                  self.experts)]
        returned = exchange_slots(torch.cat(outputs, dim=1).reshape(self.num_experts, capacity, -1), self.group)
        return unpack_slots(returned, slots)

    def _same_capacity(self, capacity: int, device: torch.device) -> int:
        """The capacity, checked equal on every rank of the group: the slot exchange sends equal parts."""
        if self.ep == 1:
            return capacity
        bounds = torch.tensor([capacity, -capacity], device=device)  # on the device the group's backend uses
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.group)
        if bounds[0] != -bounds[1]:
            raise ValueError(f"the expert group's ranks have capacities {-int(bounds[1])} to {int(bounds[0])} (their "
                             "token counts differ); with drop_tokens=True every rank of the group needs the same "
                             "number of tokens, or use drop_tokens=False")
        return capacity

    def _dropless(self, tokens: torch.Tensor, routes: Routes) -> torch.Tensor:
        """The routes' expert outputs, [k, S, M], sending each rank exactly the rows for its experts."""
        return dropless(tokens, routes.experts, self.num_experts, self.group, self.experts)

    def _with_residual(self, hidden_states: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's residual MoE: the mixture and the dense expert mixed by a learned per-token softmax."""
        dense = expert_output(self.mlp(hidden_states))
        coefficient = F.softmax(self.coefficient(hidden_states), dim=-1)
        return output * coefficient[..., 0:1] + dense * coefficient[..., 1:]


def _check(num_experts: int, ep: int, k: int, noisy_gate_policy: str | None) -> None:
    if num_experts < 1 or num_experts % ep:
        raise ValueError(f"num_experts={num_experts} does not divide over the expert group's {ep} ranks; use a "
                         f"positive multiple of {ep}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k={k!r} is not a gate DeepSpeed has; k is a whole number from 1 (top-1, top-2, top-k)")
    if k > num_experts:
        raise ValueError(f"k={k} is above num_experts={num_experts}; use k from 1 to {num_experts}")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r} is not one of None, 'None', 'Jitter', 'RSample'")
