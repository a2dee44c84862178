"""The two collectives sequence parallelism differentiates through: the all-to-all that turns sequence shards into
head shards (and back), and the sum that combines the ranks' losses.

Written as autograd functions over torch's collectives (not torch.distributed.nn's: on gloo the backward of its
all_gather over a subgroup fails with "Global rank 0 is not part of group").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """`x` cut into equal parts along scatter_dim, part j sent to rank j of `group`; what each rank sent, joined along
    gather_dim in rank order. Its gradient is the reverse exchange."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def summed(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of `x` over the ranks of `group`, on every rank; its gradient is summed back over them (every rank's
    value depends on every rank's input), so each rank's own part of a loss gets the whole gradient."""
    return _Sum.apply(x, group)


def _exchange(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    ranks = dist.get_world_size(group)
    if x.shape[scatter_dim] % ranks:
        raise ValueError(f"dimension {scatter_dim} of a {tuple(x.shape)} tensor does not split over {ranks} sequence "
                         "ranks")
    sent = torch.stack(x.chunk(ranks, dim=scatter_dim)).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _exchange(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        total = grad.detach().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
