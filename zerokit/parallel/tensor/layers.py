"""The split linears of tensor parallelism, as DeepSpeed's AutoTP trains them: each holds its own piece of the weight
as an ordinary nn.Parameter, and the all-reduces that make the pieces compute the whole layer happen in forward and
backward through the tensor group's Communicator.

[Note: split linears hold plain parameters]
A column-parallel linear holds rows [j*n/t, (j+1)*n/t) of the weight (and of the bias) of an n-output layer on
tensor rank j: it reads the whole input and writes its slice of the output. A row-parallel linear holds the matching
columns of the next layer's weight: it reads that slice and writes a partial sum of the whole output, which one
all-reduce over the tensor group completes; its bias is not split and is added once, after the sum. In backward the
mirror image: the column-parallel layer's input gradient is a partial sum (each rank's slice of the output
contributes), completed by one all-reduce; the row-parallel layer's input gradient is its own slice already.
So two all-reduces per block in forward (after o_proj, after down_proj) and two in backward (before q/k/v, before
gate/up), on the activations, inside the node.

The pieces are ordinary parameters of this rank's shape, not DTensors: ZeRO's flat buffers, buckets, masters and
stage 3's gathers work on them as on any parameter, over the data group only, and every tensor rank's engine sees
a model of the same shapes. What ZeRO must know is which parameters are pieces (their gradients differ across the
tensor group and their squares add up across it) and which are whole (replicated: the same on every tensor rank,
counted once); `split_parameters` answers it from the modules, with no attribute on any parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerokit.comm import Communicator


class _CopyToTensorGroup(torch.autograd.Function):
    """Forward: the input as it is (every tensor rank holds it whole). Backward: the sum of the ranks' input
    gradients, each a partial sum through this rank's slice of a column-parallel layer."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, op=dist.ReduceOp.SUM, purpose="tensor parallel: input gradient of a column split")
        return grad, None


class _SumOverTensorGroup(torch.autograd.Function):
    """Forward: the sum of the ranks' partial outputs of a row-parallel layer. Backward: the gradient as it is
    (each rank's slice of the input gets the whole output's gradient)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, comm: Communicator) -> torch.Tensor:
        total = partial.contiguous().clone()
        comm.all_reduce(total, op=dist.ReduceOp.SUM, purpose="tensor parallel: output of a row split")
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """Forward: every rank's slice of the last dimension, concatenated in tensor-rank order. Backward: this rank's
    slice of the gradient (every rank computes the same loss from the whole output, so no sum is needed)."""

    @staticmethod
    def forward(ctx: Any, piece: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.rank, ctx.width = comm.rank, piece.shape[-1]
        flat = piece.new_empty(comm.world_size * piece.numel())  # (t * B * T * width,) rank-major
        comm.all_gather(flat, piece.contiguous().reshape(-1), purpose="tensor parallel: gathered output")
        pieces = flat.view(comm.world_size, *piece.shape)
        return torch.cat(pieces.unbind(0), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a linear layer's weight and bias (See [Note: split linears hold plain parameters]).
    gather_output: all-gather the slices into the whole output (an LM head whose logits the loss reads whole)."""

    split_dims = {"weight": 0, "bias": 0}
    """The dimension each parameter is split on (for consolidating a checkpoint to full tensors)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: Communicator,
                 gather_output: bool = False) -> None:
        """`weight` (out_features / t, in_features) and `bias` (out_features / t): this rank's pieces."""
        super().__init__()
        self.comm, self.gather_output = comm, gather_output
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias

    @classmethod
    def split(cls, linear: nn.Linear, comm: Communicator, gather_output: bool = False) -> "ColumnParallelLinear":
        """This tensor rank's piece of a whole linear."""
        bias = None if linear.bias is None else _piece(linear.bias, 0, comm)
        return cls(_piece(linear.weight, 0, comm), bias, comm, gather_output)

    @classmethod
    def from_piece(cls, local: nn.Linear, comm: Communicator, gather_output: bool = False) -> "ColumnParallelLinear":
        """A linear that holds this rank's piece already (a DTensor linear's local tensors: See torch_tp.py)."""
        return cls(local.weight, local.bias, comm, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features), whole on every tensor rank
        out = F.linear(_CopyToTensorGroup.apply(x, self.comm), self.weight, self.bias)  # (..., out_features / t)
        return _GatherLastDim.apply(out, self.comm) if self.gather_output else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (of "
                f"{self.out_features * self.comm.world_size}), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """This rank's columns of a linear layer's weight; the bias whole, added once after the sum (See [Note: split
    linears hold plain parameters])."""

    split_dims = {"weight": 1}

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: Communicator) -> None:
        """`weight` (out_features, in_features / t): this rank's piece; `bias` (out_features): replicated, the same
        on every tensor rank."""
        super().__init__()
        self.comm = comm
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias

    @classmethod
    def split(cls, linear: nn.Linear, comm: Communicator) -> "RowParallelLinear":
        """This tensor rank's piece of a whole linear (its bias whole)."""
        return cls(_piece(linear.weight, 1, comm), linear.bias, comm)

    @classmethod
    def from_piece(cls, local: nn.Linear, comm: Communicator) -> "RowParallelLinear":
        """A linear that holds this rank's piece already (See torch_tp.py)."""
        return cls(local.weight, local.bias, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features / t), this rank's slice
        out = _SumOverTensorGroup.apply(F.linear(x, self.weight), self.comm)  # (..., out_features), whole
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.in_features * self.comm.world_size}), "
                f"out_features={self.out_features}")


SPLIT_LINEARS = (ColumnParallelLinear, RowParallelLinear)


def _piece(whole: nn.Parameter, dim: int, comm: Communicator) -> nn.Parameter:
    """This tensor rank's contiguous piece of `whole` along `dim` (a copy: the whole tensor can go)."""
    piece = whole.detach().chunk(comm.world_size, dim=dim)[comm.rank].clone()
    return nn.Parameter(piece, requires_grad=whole.requires_grad)


def split_parameters(model: nn.Module) -> dict[int, int]:
    """id -> split dimension of every parameter of `model` that is one tensor rank's piece: the weights (and
    column-split biases) of the split linears. The others are whole on every tensor rank."""
    split: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, SPLIT_LINEARS):
            for name, dim in module.split_dims.items():
                param = getattr(module, name)
                if param is not None:
                    split[id(param)] = dim
    return split
