"""`deepspeed.moe.layer` for zerokit: DeepSpeed's MoE layer, its arguments, its parameter names and its return, over
zerokit's ExpertParallelMoE (zerokit/parallel/experts/layer.py: DeepSpeed's gate and dispatch, reproduced).

[Note: the drop-in's expert degree]
At ep_size=1 every expert of a layer lives on every rank: the layer trains at ZeRO 0-3 as any module does, its
experts' states sharded with the rest. At ep_size > 1 each rank holds num_experts / ep_size of them:
deepspeed.initialize gives the layer its expert group (DeepSpeed's order: See [Note: the expert dimension] in
zerokit/parallel/mesh.py) and shards and averages its experts' states over their expert-data group at ZeRO 0-3,
clipping by the global norm (See [Note: ZeRO over experts split across ranks] in zerokit/parallel/experts/share.py).
DeepSpeed refuses its native MoE at ZeRO 3; zerokit trains it there, the dense parameters sharded as always.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from zerokit._support.log import logger
from zerokit.deepspeed.moe.utils import mark_expert_parameters
from zerokit.parallel.experts.layer import ExpertParallelMoE


class Experts(nn.Module):
    """DeepSpeed's container of a layer's local experts (its parameter names: `deepspeed_experts.<i>.`)."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__()
        self.deepspeed_experts = experts

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.deepspeed_experts)

    def __len__(self) -> int:
        return len(self.deepspeed_experts)


class MoE(nn.Module):
    """DeepSpeed's MoE layer: `num_experts` copies of `expert` behind DeepSpeed's top-k gate; forward returns
    (output, l_aux, exp_counts). See [Note: the drop-in's expert degree] for ep_size."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _check_expert_degree(ep_size, num_experts)
        _log_speed_knobs(use_tutel, enable_expert_tensor_parallelism)
        self.use_residual, self.enable_expert_tensor_parallelism = use_residual, enable_expert_tensor_parallelism
        self.ep_size, self.expert_group_name = ep_size, f"ep_size_{ep_size}"
        self.num_experts, self.num_local_experts = num_experts, num_experts // ep_size
        self.deepspeed_moe = ExpertParallelMoE(hidden_size, expert, num_experts, None, k, capacity_factor,
                                               eval_capacity_factor, min_capacity, drop_tokens, False,
                                               noisy_gate_policy, use_rts, top2_2nd_expert_sampling, ep_size=ep_size)
        self.deepspeed_moe.experts = Experts(self.deepspeed_moe.experts)
        mark_expert_parameters(self.deepspeed_moe.experts, self.expert_group_name)
        if use_residual:  # after the gate, as DeepSpeed makes them: a seeded model starts from DeepSpeed's weights
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls it to make the expert groups; zerokit's engine gives each layer its group from the
        job's layout when it is built (See [Note: the drop-in's expert degree])."""

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output, l_aux, exp_counts = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense  # a bias returned beside it is left out
            coefficient = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coefficient[..., 0:1] + dense * coefficient[..., 1:]
        return output, l_aux, exp_counts


def _check_expert_degree(ep_size: Any, num_experts: Any) -> None:
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"MoE(ep_size={ep_size!r}): the expert-parallel size must be a positive integer")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"MoE(num_experts={num_experts!r}): the number of experts must be a positive integer")


def _log_speed_knobs(use_tutel: bool, enable_expert_tensor_parallelism: bool) -> None:
    if use_tutel:
        logger.info("MoE(use_tutel=True): Tutel's kernels only speed DeepSpeed's dispatch; zerokit's is used")
    if enable_expert_tensor_parallelism:
        logger.info("MoE(enable_expert_tensor_parallelism=True): without tensor parallelism DeepSpeed ignores it too")


__all__ = ["MoE"]
