"""Which parameters got a gradient in an accumulation window: on this rank, then on any rank.

[Note: parameters no rank used]
A parameter that gets no gradient (a branch no batch took, an MoE expert no token reached) keeps
`.grad is None` in one process, and torch's optimizers skip it: its weights, its state and its step
count stay put. zerokit reduces it as a zero gradient like any other (every rank must issue the same
collectives), so it has to know whether *any* rank used it before the optimizer steps: one flag per
parameter, set by the gradient hooks, summed across ranks inside a reduction that happens anyway (the
boundary's gradient-norm all-reduce at stages 1-3; at stage 0, which computes the norm locally, the
last gradient bucket's all-reduce, which carries the flags right behind the bucket). A parameter
some rank used is averaged as usual (the others add zeros), and stepped.
"""

from __future__ import annotations

import torch


class GradientUsage:
    def __init__(self, count: int) -> None:
        self.local = [False] * count  # got a gradient on this rank, this window
        self.agreed: list[bool] | None = None if count else []  # got one on some rank: once the flags are reduced

    def mark(self, param_index: int) -> None:
        self.local[param_index] = True

    def flags(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """1 for each parameter this rank used, 0 for the others."""
        return torch.tensor(self.local, dtype=dtype, device=device)

    def agree(self, summed: torch.Tensor) -> None:
        """`summed`: the flags summed (or averaged) over the ranks."""
        self.agreed = (summed > 0).tolist()

    def reset(self) -> None:
        self.local = [False] * len(self.local)
        self.agreed = None if self.local else []
