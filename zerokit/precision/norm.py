"""The global gradient norm across shards, and with it the overflow decision.

[Note: one scalar decides overflow and norm]
The squared gradient norm is inf or nan exactly when some gradient element is (or when a finite
gradient is so large its square overflows fp32, which is no better). So every rank sums the squares
of the gradient elements it owns, one scalar all-reduce adds them up, and that single number gives
both the global norm for clipping and the overflow decision, identical on all ranks by construction.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zerokit.comm import Communicator
from zerokit.precision.arithmetic import square_sum


def global_norm(squares: float, comm: Communicator | None, flags: torch.Tensor | None = None) -> float:
    """The L2 norm from this rank's sum of squares. Pass `comm` when each rank holds a different shard
    (the sums are added across ranks), None when every rank holds the same full gradients. See [Note: one
    scalar decides overflow and norm]. `flags` (1-D float64), when given with `comm`, are summed across
    ranks, in place, by the same all-reduce (See [Note: parameters no rank used] in stages/usage.py)."""
    if comm is not None:
        packed = torch.tensor([squares], dtype=torch.float64, device=comm.device)
        if flags is not None:
            packed = torch.cat([packed, flags.to(packed)])
        comm.all_reduce(packed, op=dist.ReduceOp.SUM, purpose="the boundary norm (and which parameters each rank used)")
        squares = packed[0].item()
        if flags is not None:
            flags.copy_(packed[1:])
    return math.sqrt(squares) if math.isfinite(squares) else float("nan")


def global_grad_norm(grads: list[torch.Tensor], comm: Communicator | None, flags: torch.Tensor | None = None) -> float:
    """L2 norm over all gradient elements of all ranks: global_norm of their square_sum."""
    return global_norm(square_sum(grads), comm, flags)
