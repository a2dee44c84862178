"""Tokens to their experts' ranks and back: the all-to-all exchanges of expert parallelism, as autograd functions
over torch's collectives, and the packing of routes into the capacity-shaped buffer.

[Note: the expert exchange]
An expert group of `ep` ranks holds E experts, E / ep on each, in DeepSpeed's order: expert e lives on the group's
rank e // (E / ep), as its local expert e % (E / ep). Every rank routes its own tokens (gate.py), then:
- With a capacity (drop_tokens): each rank packs its routes into an [E, C, M] buffer, route (e, place c) at [e, c],
  the slots no route took left zero. The buffer's E rows cut into ep equal blocks of E / ep experts; block j goes to
  rank j (`exchange_slots`, one all_to_all_single of equal parts). Rank j receives [ep, E / ep, C, M]: from each
  source rank, the slots of its own experts. Every rank must have the same C (the same token count), or the parts
  would not match: the layer checks it.
- Dropless: each rank sorts its routes by expert and sends each rank exactly the routes for that rank's experts
  (`exchange_rows`, all_to_all_single with split sizes), after telling every rank how many rows per local expert to
  expect (`exchange_counts`). Rank j receives, source by source, its experts' rows, expert by expert.
The experts' outputs go back by the same exchange with the roles turned: what rank j received from rank i, computed
on, returns to rank i in the place it came from.
The backward of an exchange is the reverse exchange. The forward moves row r of rank i's input to place p of rank
j's output, a permutation of rows across the ranks with nothing added or scaled; the gradient of a permutation is
its inverse, so the gradient at rank j's place p must go back to rank i's row r, which is what the exchange with the
send and receive sizes swapped does. With equal parts the swapped exchange is the exchange itself (block j of rank i
goes to block i of rank j, and back), so `exchange_slots` is its own backward. No gradient crosses `exchange_counts`
(counts are integers that only size the exchange).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn


def group_size(group: Any) -> int:
    """The ranks of an expert group; None is one process."""
    return 1 if group is None else dist.get_world_size(group)


def slot_indices(experts: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Each route's row in the flat [E * C (+1)] buffer: expert * C + place; a dropped route (expert -1) the extra
    last row, which is never sent and reads as zero, so packing and combining need no branch per route."""
    flat = experts * capacity + locations
    return torch.where(experts >= 0, flat, torch.full_like(flat, num_experts * capacity))


def pack_slots(tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[S, M] tokens into the [E, C, M] buffer, each route's token at its slot, the rest zero. Written as a gather
    (which token fills each slot) rather than a scatter of k copies of the input; its gradient sums a token's
    routes."""
    num_tokens, width = tokens.shape
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    source.scatter_(0, slots.reshape(-1), torch.arange(num_tokens, device=tokens.device).repeat(slots.shape[0]))
    padded = torch.cat([tokens, tokens.new_zeros(1, width)])  # row S: the zero an empty slot reads
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, width)


def unpack_slots(outputs: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The [E, C, M] buffer's rows back to the routes, [k, S, M]; a dropped route reads zero."""
    flat = outputs.reshape(-1, outputs.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])
    return padded.index_select(0, slots.reshape(-1)).view(*slots.shape, flat.shape[-1])


def combine(routed: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[k, S, M] expert outputs weighted by the [k, S] fp32 combine weights, summed over the routes in fp32 (as
    DeepSpeed does: summing in bf16 loses precision), in the model's dtype."""
    return (routed * weights.unsqueeze(-1)).sum(0).to(dtype)


def dropless(tokens: torch.Tensor, routes: torch.Tensor, num_experts: int, group: Any,
             experts: Sequence[nn.Module]) -> torch.Tensor:
    """The routes' expert outputs, [k, S, M], from `tokens` [S, M] and `routes` [k, S] (route j * S + s: token s's
    j-th choice; -1 none), sending each rank of `group` exactly the rows for its experts and `experts` (this rank's,
    in order) running on the rows every rank sent (See [Note: the expert exchange])."""
    flat = routes.reshape(-1)
    taken = torch.nonzero(flat >= 0).squeeze(1)
    order = taken[torch.argsort(flat[taken], stable=True)]  # the routes by expert
    counts = torch.bincount(flat[taken], minlength=num_experts)
    incoming = exchange_counts(counts, group)  # [ep, E / ep]
    sent, received = counts.view(group_size(group), -1).sum(1).tolist(), incoming.sum(1).tolist()
    rows = exchange_rows(tokens[order % tokens.shape[0]], sent, received, group)
    returned = exchange_rows(run_local_experts(experts, rows, incoming), received, sent, group)
    width = returned.shape[-1]
    routed = returned.new_zeros(flat.shape[0], width).index_copy(0, order, returned)
    return routed.view(*routes.shape, width)


def run_local_experts(experts: Sequence[nn.Module], rows: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
    """Rows received source by source, expert by expert ([ep, E / ep] counts), through their experts, in the same
    order. Every expert runs, on no rows if none came, so each has a gradient (and, at ZeRO-3, is gathered and freed
    on every rank alike)."""
    pieces = rows.split(incoming.reshape(-1).tolist())
    local = len(experts)
    outputs: list[torch.Tensor | None] = [None] * len(pieces)
    for index, expert in enumerate(experts):
        mine = list(range(index, len(pieces), local))  # expert `index`'s rows from each source
        result = expert_output(expert(torch.cat([pieces[at] for at in mine])))
        for at, part in zip(mine, result.split([pieces[at].shape[0] for at in mine])):
            outputs[at] = part
    return torch.cat(outputs)


def expert_output(result: Any) -> torch.Tensor:
    """An expert's output; of a tuple (output, bias), the output, as DeepSpeed takes it."""
    return result[0] if isinstance(result, tuple) else result


def exchange_slots(buffer: torch.Tensor, group: Any) -> torch.Tensor:
    """[E, C, M]: block j of E / ep experts to rank j of `group`; what each rank sent, in rank order, back in the same
    shape. Its own backward (See [Note: the expert exchange])."""
    if group_size(group) == 1:
        return buffer.contiguous()
    return _SlotExchange.apply(buffer, group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """[E] int64 rows per expert from this rank -> [ep, E / ep]: row i, how many rows rank i sends for each local
    expert."""
    ranks = group_size(group)
    if ranks == 1:
        return counts.view(1, -1)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ranks, -1)


def exchange_rows(rows: torch.Tensor, sent: list[int], received: list[int], group: Any) -> torch.Tensor:
    """[sum(sent), M] rows, the first sent[0] to rank 0 of `group` and so on; what every rank sent here, received[i]
    rows from rank i, in rank order. Its backward sends the gradients back (See [Note: the expert exchange])."""
    if group_size(group) == 1:
        return rows
    return _RowExchange.apply(rows, sent, received, group)


def _all_to_all(rows: torch.Tensor, sent: list[int] | None, received: list[int] | None, group: Any) -> torch.Tensor:
    rows = rows.contiguous()
    shape = rows.shape if received is None else (sum(received), *rows.shape[1:])
    output = rows.new_empty(shape)
    dist.all_to_all_single(output, rows, output_split_sizes=received, input_split_sizes=sent, group=group)
    return output


class _SlotExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buffer: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(buffer, None, None, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_to_all(grad, None, None, ctx.group), None


class _RowExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sent: list[int], received: list[int], group: Any) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group = sent, received, group
        return _all_to_all(rows, sent, received, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_to_all(grad, ctx.received, ctx.sent, ctx.group), None, None, None
