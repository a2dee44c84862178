"""The fp32 master weights of the slices this rank updates, their gradients, and the user's optimizer
rebuilt over them: one owner, with a small interface a stage talks to (hand in a reduced gradient
shard, step, publish the updated values into the compute-dtype shards, count bytes, save and load).
This is the default tier, where masters live on the device the model computes on; an offload tier
(host memory, NVMe) implements the same interface.

[Note: optimizer pieces]
A master is one flat tensor per bucket (25 MiB by default), but on the CPU the optimizer does not
step it whole: torch's CPU optimizers run one element-wise op after another over each tensor, and
over a tensor far larger than the cache every op streams it from memory again. Stepping the master
in cache-sized pieces (views of it, each its own Parameter to the optimizer) halves AdamW's step
time on this 2-core machine (77 ms -> 36 ms for 10.9M elements, 64K-element pieces), and is exact:
these optimizers update each element from its own gradient and state alone. On CUDA the fused and
foreach kernels want few large tensors, so a master is one piece there. The piece size follows the
device the master lives on, not the one the model computes on.

[Note: masters that alias the compute shard]
In fp32 training the master and the compute parameter would hold the same numbers, so where both live
on one device the master *is* the compute shard (a view of the flat buffer, or of stage 3's shard
buffer): the optimizer updates the parameters in place and publishing copies nothing. A 16-bit compute
dtype, or a master on another tier, gets its own fp32 tensor.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from zerokit.defaults import CPU_OPTIMIZER_PIECE_NUMEL
from zerokit.flat import tensor_bytes
from zerokit.masters.optimizer import rebuild_optimizer

# Default elements per optimizer piece, by the type of device the masters live on; absent: one piece
# per master. See [Note: optimizer pieces].
OPTIMIZER_PIECE_NUMEL = {"cpu": CPU_OPTIMIZER_PIECE_NUMEL}


class DeviceMasters:
    def __init__(self, compute: list[torch.Tensor], groups: list[int], optimizer: torch.optim.Optimizer,
                 sub_group_size: int | None) -> None:
        """`compute[i]`: the compute-dtype shard master i updates (1-D); `groups[i]`: its optimizer param
        group. Masters that do not alias their compute shard start uninitialised: see `initialise`."""
        self.compute = compute
        device = compute[0].device if compute else torch.device("cpu")
        # See [Note: masters that alias the compute shard]
        self.aliased = bool(compute) and compute[0].dtype == torch.float32
        self.masters = [nn.Parameter(shard if self.aliased else torch.empty(shard.numel(), device=device))
                        for shard in compute]
        self.piece_numel = sub_group_size or OPTIMIZER_PIECE_NUMEL.get(device.type, sys.maxsize)
        self.pieces = [_split(master, self.piece_numel) for master in self.masters]
        pieces_by_group: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
        for group, pieces in zip(groups, self.pieces):
            pieces_by_group[group].extend(pieces)
        self.optimizer = rebuild_optimizer(optimizer, pieces_by_group)
        self.grads: list[torch.Tensor | None] = [None] * len(compute)

    def initialise(self, index: int, values: torch.Tensor) -> None:
        """Master `index` starts from `values` (1-D, full precision: the user's own weights, not their
        16-bit rounding). An aliased master already holds them: its compute shard was filled first."""
        if not self.aliased:
            self.masters[index].data.copy_(values)

    # --- one optimizer step -----------------------------------------------------------------------
    def accept_grad(self, index: int, grad: torch.Tensor) -> None:
        """The reduced gradient of master `index` (1-D, reduce dtype), final for this step."""
        self.grads[index] = grad

    def gradients(self) -> list[torch.Tensor]:
        """Every master's fp32 gradient (a transient copy only if gradients are 16-bit), attached to its
        pieces for the optimizer; unscaling and clipping act on these in place."""
        grads = []
        for index, pieces in enumerate(self.pieces):
            grad = self.grads[index]
            if grad is None:
                raise RuntimeError(f"master {index} got no gradient before the optimizer step (an internal bug)")
            grad = grad if grad.dtype == torch.float32 else grad.float()
            for piece, piece_grad in zip(pieces, grad.split(self.piece_numel)):
                piece.grad = piece_grad
            grads.append(grad)
        return grads

    def step(self) -> None:
        self.optimizer.step()

    def release_grads(self) -> None:
        self.grads = [None] * len(self.masters)
        for pieces in self.pieces:
            for piece in pieces:
                piece.grad = None

    def publish(self) -> None:
        """Updated masters -> their compute-dtype shards."""
        if not self.aliased:
            for master, shard in zip(self.masters, self.compute):
                shard.copy_(master.detach())

    def write_back(self) -> None:
        """The user edited the compute shards in place: make the masters agree."""
        if not self.aliased:
            for master, shard in zip(self.masters, self.compute):
                copy_edits(master.data, shard)

    # --- what it holds -------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """fp32 masters (unless they alias the compute shards) and the optimizer's own state."""
        state = [t for per_piece in self.optimizer.state.values() for t in per_piece.values()]
        return (0 if self.aliased else tensor_bytes(self.masters)) + tensor_bytes(state)

    def __iter__(self):
        """The fp32 master tensors, one per bucket."""
        return iter(self.masters)

    def __len__(self) -> int:
        return len(self.masters)

    @property
    def piece_count(self) -> int:
        return sum(len(pieces) for pieces in self.pieces)

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [master.detach() for master in self.masters], "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"the saved optimizer state has {len(state['masters'])} masters, this layout "
                             f"{len(self.masters)}")
        with torch.no_grad():
            for master, saved in zip(self.masters, state["masters"]):
                master.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])


def _split(master: nn.Parameter, piece_numel: int) -> list[nn.Parameter]:
    """`master` as Parameters that are views of it, of at most piece_numel elements each."""
    if master.numel() <= piece_numel:
        return [master]
    return [nn.Parameter(view) for view in master.detach().split(piece_numel)]


def copy_edits(master: torch.Tensor, compute: torch.Tensor) -> None:
    """Copy into the fp32 `master` only the elements whose 16-bit `compute` copy no longer matches it:
    copying all of them would round every untouched master weight to 16 bits."""
    edited = compute != master.to(compute.dtype)
    master[edited] = compute[edited].to(master.dtype)
