"""DeepSpeed's gate (deepspeed/moe/sharded_moe.py, 0.19.8: TopKGate, top1gating, top2gating, topkgating), written
anew so that a DeepSpeed MoE script's routes, auxiliary loss and losses are the same under zerokit: every token's
expert(s), its place in the expert's capacity, its combine weight, the load-balancing loss and the expert counts.

[Note: DeepSpeed's gate]
The gate is a bias-free linear map to one logit per expert, in fp32 whatever the model's dtype; the softmax of the
logits is each token's probability per expert.
- k = 1: the most probable expert (argmax of the logits plus Gumbel noise under noisy_gate_policy "RSample", in
  training); the combine weight is that expert's probability, unnormalized. l_aux = E * sum_e(me_e * ce_e), me the
  mean probability of expert e, ce the fraction of tokens whose first choice is e, counted before any token is dropped.
  An expert over capacity keeps the tokens with the largest uniform draws (use_rts, "random token selection", drawn
  in eval too) or, without use_rts, whichever of its tokens torch.topk returns among equal values (not the first ones:
  on CPU, of four tied tokens 0, 1, 3, 4 it keeps 1 and 4 at capacity 2). used_token (a 0/1 per token) leaves
  tokens out of the choice, the counts and l_aux. DeepSpeed asserts S >= min_capacity at top-1, even without
  dropping; here that is a ValueError.
- k = 2: the most probable expert, then the best other one by the logits plus Gumbel noise (top2_2nd_expert_sampling,
  drawn in eval too). The second choices queue behind all of the expert's first choices, and a choice past capacity is
  dropped; the two weights are renormalized to sum to 1 over the choices kept. l_aux = E * E * mean_e(me_e * ce_e) with
  ce from the first choices only. noisy_gate_policy "RSample" has no effect at k >= 2, nor has used_token (DeepSpeed
  ignores both; a used_token here is refused).
- k >= 3: the k most probable experts; an expert over capacity keeps its tokens of highest probability ("probs"
  policy); the weights are renormalized over the choices kept. l_aux = E * E * mean_e(me_e * ce_e) / k with ce over all
  k choices.
- capacity = max(ceil(S / E * capacity_factor * k'), min_capacity), S the tokens of this rank, k' = 1 for top-1, 2
  for top-2 and k above, computed in fp32 as DeepSpeed does (its ceiling can land one above the exact value's).
  eval_capacity_factor replaces capacity_factor outside training. Without drop_tokens no token is dropped, and the
  capacity is not needed here (dispatch.py sends variable counts; DeepSpeed pads every expert to the largest count in
  the expert group, which changes nothing but the padding, and at top-1 caps that at the rank's own token count, so
  that its ranks must hold equal token counts there too).
- exp_counts: per expert, the choices made before dropping (all k of each token's).
- Everything is this rank's: l_aux, exp_counts and the capacity are of its own tokens, never summed over the group.
- "Jitter" multiplies the gate's input by a uniform draw in [0.99, 1.01) in training, at every k.
The random draws come from torch's default generator in DeepSpeed's order: the jitter (the input's shape), the
top-1 Gumbel noise (the logits' shape), the top-1 random token selection (S x E), or the top-2 Gumbel noise (the
logits' shape), through the same torch.distributions samplers, so a seeded run draws the same numbers.

DeepSpeed's gate differs from the routers of transformers' Mixtral and Qwen-MoE (modeling_mixtral.py's
load_balancing_loss_func): those take the top-k by probability, renormalize over them (Mixtral; Qwen by its
norm_topk_prob), never drop a token, and compute one aux loss, E * sum_e(f_e * P_e) (f_e the fraction of the top-k
assignments that go to e, summing to k; P_e the mean probability), over all layers' router logits of the whole batch
at once, masked by the attention mask, added to the model's loss times router_aux_loss_coef. Neither has a z-loss;
Switch Transformers and NLLB-MoE add mean(logsumexp(logits) ** 2). Only DeepSpeed's gate is implemented here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
JITTER_EPSILON = 1e-2


@dataclass(frozen=True)
class GateSettings:
    """How the gate routes (DeepSpeed's MoE arguments of the same names)."""
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    noisy_gate_policy: str | None = None
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True


@dataclass
class Routes:
    """Each token's k routes (route j of token s at [j, s]), and what the gate measured."""
    experts: torch.Tensor    # [k, S] int64: the expert, -1 where the route was dropped
    locations: torch.Tensor  # [k, S] int64: the route's place in its expert's capacity (0 where dropped)
    weights: torch.Tensor    # [k, S] fp32, differentiable: the combine weight (0 where dropped)
    l_aux: torch.Tensor      # the load-balancing loss, differentiable
    exp_counts: torch.Tensor  # [E]: the choices per expert before dropping
    capacity: int | None     # the slots per expert; None without drop_tokens (no token is dropped)


class Gate(nn.Module):
    """DeepSpeed's TopKGate: `wg` (hidden -> num_experts, no bias, created as DeepSpeed creates it, so a seeded
    model draws the same initial weights) and the routing of [S, hidden] tokens."""

    def __init__(self, hidden_size: int, num_experts: int, settings: GateSettings) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)
        self.settings = settings

    def forward(self, tokens: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
        tokens = tokens.float()  # the gate works in fp32 at any model dtype, as DeepSpeed's does
        if self.settings.noisy_gate_policy == "Jitter" and self.training:
            tokens = tokens * _uniform(1.0 - JITTER_EPSILON, 1.0 + JITTER_EPSILON, tokens)
        logits = F.linear(tokens, self.wg.weight.float())
        return route(logits, self.settings, self.training, used_token)


def route(logits: torch.Tensor, settings: GateSettings, training: bool,
          used_token: torch.Tensor | None = None) -> Routes:
    """The routes of [S, E] fp32 logits under `settings` (training: the training capacity factor and noise)."""
    factor = settings.capacity_factor if training else settings.eval_capacity_factor
    if settings.k == 1:
        noisy = settings.noisy_gate_policy == "RSample" and training
        return top1_routes(logits, factor, settings, noisy, used_token)
    if used_token is not None:
        raise ValueError(f"used_token masks tokens at k=1 only (DeepSpeed ignores it at k={settings.k}); "
                         "pass used_token=None")
    if settings.k == 2:
        return top2_routes(logits, factor, settings)
    return topk_routes(logits, factor, settings)


def capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """The slots per expert: ceil(tokens / experts * factor), at least min_capacity. In fp32, as DeepSpeed computes it
    (its capacity factor is a 0-d fp32 tensor), so that the same tokens are dropped."""
    scaled = (tokens / experts) * torch.tensor(factor)
    return max(int(torch.ceil(scaled)), min_capacity)


def top1_routes(logits: torch.Tensor, factor: float, settings: GateSettings, noisy: bool,
                used_token: torch.Tensor | None) -> Routes:
    """DeepSpeed's top1gating (See [Note: DeepSpeed's gate])."""
    noise = _gumbel(logits) if noisy else None  # drawn before the token selection's draw, as DeepSpeed does
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    chosen = torch.argmax(logits + noise if noisy else gates, dim=1)
    mask = F.one_hot(chosen, num_classes=num_experts)
    if used_token is not None:
        mask = torch.einsum("s,se->se", used_token, mask)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    scores = mask * _uniform(0.0, 1.0, mask) if settings.use_rts else mask  # drawn even in eval, even dropless
    if num_tokens < settings.min_capacity:
        raise ValueError(f"top-1 gating needs at least min_capacity={settings.min_capacity} tokens per rank, got "
                         f"{num_tokens}; lower min_capacity or give each rank more tokens")
    slots = None
    if settings.drop_tokens:
        slots = capacity(num_tokens, num_experts, factor, settings.min_capacity)
        mask = mask * _kept_by_score(scores, slots).to(mask.dtype)
    kept = mask.sum(dim=1) > 0
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    weights = torch.sum(gates * mask, dim=1)  # the probability itself: top-1 does not renormalize
    experts = torch.where(kept, chosen, torch.full_like(chosen, -1))
    return Routes(experts.unsqueeze(0), locations.long().unsqueeze(0), weights.unsqueeze(0), l_aux, exp_counts, slots)


def top2_routes(logits: torch.Tensor, factor: float, settings: GateSettings) -> Routes:
    """DeepSpeed's top2gating (See [Note: DeepSpeed's gate])."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if settings.top2_2nd_expert_sampling:  # Gumbel-max: the second choice sampled in proportion to its probability
        logits = logits + _gumbel(logits)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # behind every first choice
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    slots = None
    if settings.drop_tokens:
        slots = capacity(num_tokens, num_experts, factor * 2, settings.min_capacity)
        mask1 = mask1 * (locations1 < slots)
        mask2 = mask2 * (locations2 < slots)
    kept1, kept2 = mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0
    weight1 = gates.gather(1, first.unsqueeze(1)).squeeze(1) * kept1
    weight2 = gates.gather(1, second.unsqueeze(1)).squeeze(1) * kept2
    total = torch.clamp(weight1 + weight2, min=torch.finfo(gates.dtype).eps)  # both dropped: weights stay 0
    experts = torch.stack([torch.where(kept1, first, -1), torch.where(kept2, second, -1)])
    locations = torch.stack([torch.sum(locations1 * mask1, dim=1), torch.sum(locations2 * mask2, dim=1)])
    return Routes(experts, locations, torch.stack([weight1 / total, weight2 / total]), l_aux, exp_counts, slots)


def topk_routes(logits: torch.Tensor, factor: float, settings: GateSettings) -> Routes:
    """DeepSpeed's topkgating with its default drop policy, "probs" (See [Note: DeepSpeed's gate])."""
    k = settings.k
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gates, chosen = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, chosen, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    slots = None
    if settings.drop_tokens:
        slots = capacity(num_tokens, num_experts, factor * k, settings.min_capacity)
        by_probability = torch.zeros_like(gates).scatter(1, chosen, top_gates)
        mask &= _kept_by_score(by_probability, slots, ordered=False).bool()
    locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, chosen)
    experts = torch.where(kept, chosen, torch.full_like(chosen, -1))
    return Routes(experts.t(), (locations.gather(1, chosen) * kept).t(), masked.gather(1, chosen).t(), l_aux,
                  exp_counts, slots)


def _kept_by_score(scores: torch.Tensor, slots: int, ordered: bool = True) -> torch.Tensor:
    """Per expert (column), 1 for the `slots` tokens of highest score, 0 elsewhere: torch.topk's choice among ties,
    sorted or not as DeepSpeed asks (top-1 sorted, top-k not), since that can change which tied tokens it returns."""
    rows = min(slots, scores.shape[0])  # topk cannot take more rows than there are; the capacity stays as it was
    chosen = torch.topk(scores, k=rows, dim=0, sorted=ordered)[1]
    return torch.zeros_like(scores).scatter_(0, chosen, 1)


def _uniform(low: float, high: float, like: torch.Tensor) -> torch.Tensor:
    """Uniform draws in [low, high), shaped as `like` and on its device, as DeepSpeed draws them (torch.distributions,
    fp32 bounds): from torch's default generator of that device."""
    bounds = torch.tensor(low, device=like.device), torch.tensor(high, device=like.device)
    return torch.distributions.Uniform(*bounds).rsample(like.shape)


def _gumbel(like: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel draws shaped as `like` and on its device, as DeepSpeed draws them (torch.distributions)."""
    bounds = torch.tensor(0.0, device=like.device), torch.tensor(1.0, device=like.device)
    return torch.distributions.Gumbel(*bounds).rsample(like.shape)
