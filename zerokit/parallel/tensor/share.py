"""The tensor group as the optimizer step sees it: which of this rank's parameters are pieces of split layers, and
the one scalar all-reduce that makes the gradient norm and the overflow decision count every element once.

[Note: each element counted once across tensor and data ranks]
An engine shards over its data group, so the sum of squares its data group agrees on covers one tensor rank's
model: its pieces of the split layers and a whole copy of every replicated parameter (norms, embeddings, a row split's
bias). The model's norm adds the pieces of every tensor rank and one copy of the rest. So each rank leaves out the
replicated parameters unless it is tensor rank 0 (`uncounted`), and the data group's sums are added across the tensor
group too. The replicated parameters left out still decide overflow: their squares enter as 0 x sum, which is nan
where the sum is inf or nan, so an fp16 overflow on any rank, in any parameter, is nan on every rank after the sum
(See [Note: one scalar decides overflow and norm] in precision/norm.py). Their gradients are the same on every tensor
rank without a reduction of their own: every tensor rank reads the same batch, the split layers' all-reduces give every
tensor rank the same activations and the same input gradients, so what reaches a replicated parameter is the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerokit.comm import Communicator


class TensorShare:
    def __init__(self, comm: Communicator, split: dict[int, int], made_whole: tuple[str, ...] = ()) -> None:
        """`comm`: this rank's tensor group; `split`: id -> split dimension of each parameter that is this tensor
        rank's piece (layers.split_parameters); `made_whole`: the modules the caller's plan split that are held whole
        (See [Note: an embedding the plan splits is held whole] in torch_tp.py)."""
        self.comm, self.split, self.made_whole = comm, split, made_whole

    def uncounted(self, params: list[nn.Parameter]) -> frozenset[int]:
        """The indices in `params` whose squares this rank leaves out of the norm: the replicated ones, except on
        tensor rank 0 (See [Note: each element counted once across tensor and data ranks])."""
        if self.comm.rank == 0:
            return frozenset()
        return frozenset(index for index, param in enumerate(params) if id(param) not in self.split)

    def sum_squares(self, squares: float) -> float:
        """This rank's (data-group-local) sum of squares added across the tensor group."""
        packed = torch.tensor([squares], dtype=torch.float64, device=self.comm.device)
        self.comm.all_reduce(packed, op=dist.ReduceOp.SUM, purpose="the boundary norm, across the tensor group")
        return packed.item()

    def consolidate(self, state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """`state` (a full_state_dict of this tensor rank's model) with each split parameter's pieces gathered from
        every tensor rank into the whole tensor, as a model without tensor parallelism holds it. Every tensor rank
        calls it, and gathers the parameters in the same (the model's) order."""
        names = {name: self.split[id(param)] for name, param in model.named_parameters() if id(param) in self.split}
        for name, dim in names.items():
            piece = state[name].to(self.comm.device).contiguous()
            pieces = piece.new_empty(self.comm.world_size * piece.numel())  # (t * numel,) tensor-rank-major
            self.comm.all_gather(pieces, piece.reshape(-1), purpose=f"consolidating {name} across the tensor group")
            whole = torch.cat(pieces.view(self.comm.world_size, *piece.shape).unbind(0), dim=dim)
            state[name] = whole.to(state[name].device)
        return state

    def close(self) -> None:
        self.comm.close()
