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
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch
from torch import nn

from zerokit.defaults import CPU_OPTIMIZER_PIECE_NUMEL
from zerokit.flat import ParamSlice, tensor_bytes
from zerokit.masters.optimizer import GroupRef, rebuild_optimizer

# Default elements per optimizer piece, by the type of device the masters live on; absent: one piece
# per parameter slice. See [Note: optimizer pieces].
OPTIMIZER_PIECE_NUMEL = {"cpu": CPU_OPTIMIZER_PIECE_NUMEL}


class PieceRef(NamedTuple):
    """One optimizer piece, for code that saves or loads per parameter (checkpoints): its values are
    `piece.data` (a view of the master) and its state `optimizer.state[piece]`."""

    param_index: int
    param_begin: int  # where the piece begins within the (flattened) parameter
    piece: nn.Parameter
    optimizer: torch.optim.Optimizer


@dataclass(frozen=True)
class OptimizerPlan:
    """The user's optimizers, and where each flattened param group of theirs comes from."""

    optimizers: tuple[torch.optim.Optimizer, ...]
    refs: tuple[GroupRef, ...]  # by flattened group index


class DeviceMasters:
    def __init__(self, compute: list[torch.Tensor], slices: list[list[ParamSlice]], groups: list[int],
                 plan: OptimizerPlan, sub_group_size: int | None) -> None:
        """`compute[i]`: the compute-dtype shard master i updates (1-D); `slices[i]`: the parameter parts it
        holds; `groups[i]`: their flattened param group. Masters that do not alias their compute shard
        start uninitialised: see `initialise`."""
        self.compute = compute
        device = compute[0].device if compute else torch.device("cpu")
        # See [Note: masters that alias the compute shard]
        self.aliased = bool(compute) and compute[0].dtype == torch.float32
        self.masters = [nn.Parameter(shard if self.aliased else torch.empty(shard.numel(), device=device))
                        for shard in compute]
        self.piece_numel = sub_group_size or OPTIMIZER_PIECE_NUMEL.get(device.type, sys.maxsize)
        self.pieces: list[list[nn.Parameter]] = []
        self.piece_params: list[list[int]] = []  # the parameter each piece is part of
        self.piece_offsets: list[list[int]] = []  # where each piece begins in its master
        self.piece_param_begins: list[list[int]] = []  # where each piece begins in its parameter
        pieces_by_group: list[list[nn.Parameter]] = [[] for _ in plan.refs]
        for master, master_slices, group in zip(self.masters, slices, groups):
            pieces, params, offsets = self._cut(master, master_slices, plan.refs[group].whole_tensor)
            self.pieces.append(pieces)
            self.piece_params.append(params)
            self.piece_offsets.append(offsets)
            starts = {part.param_index: part.param_begin - part.begin for part in master_slices}
            self.piece_param_begins.append([starts[param] + offset for param, offset in zip(params, offsets)])
            pieces_by_group[group].extend(pieces)
        self.optimizers = [rebuild_optimizer(optimizer, [pieces_by_group[g] for g, ref in enumerate(plan.refs)
                                                         if ref.optimizer == which])
                           for which, optimizer in enumerate(plan.optimizers)]
        self.grads: list[torch.Tensor | None] = [None] * len(compute)

    def _cut(self, master: nn.Parameter, slices: list[ParamSlice],
             whole_tensor: bool) -> tuple[list[nn.Parameter], list[int], list[int]]:
        """Pieces of `master` for the optimizer, with the parameter each is part of and where it begins: each
        parameter's part its own (its step count, its state; an unused one is skipped), shaped like the
        parameter for a whole-tensor optimizer, cut into cache-sized pieces otherwise (See [Note:
        optimizer pieces])."""
        values = master.detach()
        pieces, params, offsets = [], [], []
        for part in slices:
            if whole_tensor and not part.whole:
                raise RuntimeError(f"parameter {part.param_index} is split across ranks but its optimizer needs "
                                   "whole tensors (an internal bug)")
            step = part.end - part.begin if whole_tensor else self.piece_numel
            for begin in range(part.begin, part.end, step):
                end = min(begin + step, part.end)
                view = values[begin:end]
                pieces.append(nn.Parameter(view.view(part.shape) if whole_tensor else view))
                params.append(part.param_index)
                offsets.append(begin)
        return pieces, params, offsets

    def initialise(self, index: int, values: torch.Tensor) -> None:
        """Master `index` starts from `values` (1-D, full precision: the user's own weights, not their
        16-bit rounding). An aliased master already holds them: its compute shard was filled first."""
        if not self.aliased:
            self.masters[index].data.copy_(values)

    @property
    def optimizer(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        """The rebuilt optimizer, or the list of them when several were given."""
        return self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers

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
            for piece, view in zip(pieces, self._views(grad, index)):
                piece.grad = view
            grads.append(grad)
        return grads

    def drop_unused(self, used: Sequence[bool] | None) -> None:
        """Pieces of parameters that got no gradient on any rank lose theirs, so the optimizer skips them
        as torch's optimizers skip a parameter whose .grad is None (See [Note: parameters no rank used])."""
        if used is None:
            raise RuntimeError("the ranks' gradient usage was never reduced before the optimizer step (an internal bug)")
        for pieces, params in zip(self.pieces, self.piece_params):
            for piece, param in zip(pieces, params):
                if not used[param]:
                    piece.grad = None

    def _views(self, grad: torch.Tensor, index: int) -> list[torch.Tensor]:
        """`grad` (1-D, like master `index`) cut as its pieces are."""
        return [grad[offset:offset + piece.numel()].view(piece.shape)
                for piece, offset in zip(self.pieces[index], self.piece_offsets[index])]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

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
        """fp32 masters (unless they alias the compute shards) and the optimizers' own state."""
        state = [t for optimizer in self.optimizers for per_piece in optimizer.state.values()
                 for t in per_piece.values()]
        return (0 if self.aliased else tensor_bytes(self.masters)) + tensor_bytes(state)

    def piece_refs(self) -> list[PieceRef]:
        """Every optimizer piece this rank steps, with the parameter part it is and its optimizer."""
        optimizer_of = {id(p): o for o in self.optimizers for g in o.param_groups for p in g["params"]}
        return [PieceRef(param, begin, piece, optimizer_of[id(piece)])
                for pieces, params, begins in zip(self.pieces, self.piece_params, self.piece_param_begins)
                for piece, param, begin in zip(pieces, params, begins)]

    def __iter__(self):
        """The fp32 master tensors, one per bucket."""
        return iter(self.masters)

    def __len__(self) -> int:
        return len(self.masters)

    @property
    def piece_count(self) -> int:
        return sum(len(pieces) for pieces in self.pieces)

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [master.detach() for master in self.masters],
                "optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"the saved optimizer state has {len(state['masters'])} masters, this layout "
                             f"{len(self.masters)}")
        with torch.no_grad():
            for master, saved in zip(self.masters, state["masters"]):
                master.copy_(saved)
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)


def copy_edits(master: torch.Tensor, compute: torch.Tensor) -> None:
    """Copy into the fp32 `master` only the elements whose 16-bit `compute` copy no longer matches it:
    copying all of them would round every untouched master weight to 16 bits."""
    edited = compute != master.to(compute.dtype)
    master[edited] = compute[edited].to(master.dtype)
