"""Weights tied across pipeline stages (an embedding on the first stage, the output projection through it on the
last): one tensor, of which each stage holding it keeps a copy.

[Note: a tied weight's gradient across stages]
Each stage's copy gets the gradient of its own uses only; one process would add them. So the copies start equal
(broadcast from the first stage that holds them) and, at each window's end, their gradients are summed over the
tie group (the stages holding the key, same replica) before ZeRO reduces them over the data group, as DeepSpeed's
PipelineEngine does (allreduce_tied_weight_gradients before its data-parallel reduction). The sum must wait for the
schedule's end: the stages finish their backwards at different times, and a sum inside one stage's last backward
would wait for a stage that still needs this one's gradients. So the engine defers the window's reduction
(Engine.external_backward(defer_reduction=True), then reduce_deferred()), and the tied gradients are summed where
they accumulate, whole, on each rank: stages 0-1, and stage 2 reducing once per step. At stage 3 every micro-batch's
gradients leave the rank as shards of each stage's own layout, which do not line up across stages: refused.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from zerokit.comm import Communicator


class TiedWeight(NamedTuple):
    key: str
    weight: nn.Parameter  # this stage's copy
    group: dist.ProcessGroup  # the ranks holding a copy (same replica), first stage first
    ranks: list[int]


class TiedWeights:
    """This rank's tied weights, each with its tie group, counted in `stats` under "tied"."""

    def __init__(self, tied: list[TiedWeight], timeout_seconds: float, stats=None) -> None:
        self.tied = tied
        self.comms = [Communicator(t.group, stats, name="tied", timeout_seconds=timeout_seconds) for t in tied]

    def __bool__(self) -> bool:
        return bool(self.tied)

    def synchronize(self) -> None:
        """Every copy takes the first stage's values."""
        for tied, comm in zip(self.tied, self.comms):
            with torch.no_grad():
                comm.broadcast(tied.weight.data, src=0, purpose=f"tied weight {tied.key!r}: the first stage's values")

    def sum_gradients(self) -> None:
        """Each copy's window gradient becomes the sum over the stages that hold it. See [Note: a tied weight's
        gradient across stages]."""
        for tied, comm in zip(self.tied, self.comms):
            grad = tied.weight.grad
            if grad is None:
                grad = tied.weight.grad = torch.zeros_like(tied.weight)
            comm.all_reduce(grad, op=dist.ReduceOp.SUM, purpose=f"tied weight {tied.key!r}: gradients across stages")

    def counted_elsewhere(self) -> list[TiedWeight]:
        """The copies whose gradient norm the first stage of their group counts (the sum is the same on each)."""
        return [t for t in self.tied if t.ranks[0] != dist.get_rank()]

    def close(self) -> None:
        for comm in self.comms:
            comm.close()
