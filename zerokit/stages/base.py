"""What every stage shares: flat parameters, fp32 master weights for the slice this rank updates,
and the user's optimizer rebuilt over those masters. Subclasses decide only where gradients live
and how a bucket of them is reduced (see stage0.py, stage1.py, stage2.py).

[Note: optimizer pieces]
A master is one flat tensor per bucket (25 MiB by default), but on the CPU the optimizer does not
step it whole: torch's CPU optimizers run one element-wise op after another over each tensor, and
over a tensor far larger than the cache every op streams it from memory again. Stepping the master
in cache-sized pieces (views of it, each its own Parameter to the optimizer) halves AdamW's step
time on this 2-core machine (77 ms -> 36 ms for 10.9M elements, 64K-element pieces), and is exact:
these optimizers update each element from its own gradient and state alone. On CUDA the fused and
foreach kernels want few large tensors, so a master is one piece there.

[Note: reducing a bucket to a shard]
Stages 1-3 need only this rank's shard of each averaged gradient bucket. A reduce-scatter gives just
that and sends half the bytes of an all-reduce, so it is the default wherever the back-end implements
it well (NCCL). gloo does not: for a 25 MiB fp32 bucket on 2 ranks here, its reduce-scatter took
32 ms and allocated a second full-size copy, its all-reduce 14 ms in place. So on gloo the bucket,
which this rank already holds whole, is all-reduced in place and the shard is read from it: no more
memory, less time, and counted honestly as an all-reduce. `zero_optimization.reduce_scatter` forces
either choice.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Iterator, NamedTuple

import torch
from torch import nn

from zerokit.comm import Communicator, Pending, wait
from zerokit.config import ZeroConfig
from zerokit.defaults import CPU_OPTIMIZER_PIECE_NUMEL
from zerokit.flat import Bucket, FlatParameters, bucket_view, build_layout, shard_view
from zerokit.stages.optimizer import rebuild_optimizer


class BucketReduction(NamedTuple):
    """A bucket's reduction in flight: wait on `pending`, then call `finish` to store the result.
    `staging` keeps the collective's input alive until then."""

    pending: Pending
    finish: Callable[[], None] | None
    staging: torch.Tensor | None = None


# Default elements per optimizer piece, by device type; absent: one piece per master. See [Note: optimizer pieces].
OPTIMIZER_PIECE_NUMEL = {"cpu": CPU_OPTIMIZER_PIECE_NUMEL}


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


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class ZeroStage:
    shards_optimizer: ClassVar[bool] = True
    """False only for stage 0, where every rank updates every parameter."""
    reduces_every_micro_step: bool = False
    """True where gradients must leave the rank on every micro-step (stage 2's default)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], groups: list[int],
                 optimizer: torch.optim.Optimizer, config: ZeroConfig, comm: Communicator) -> None:
        """`params` in expected backward order; `groups[i]` is params[i]'s optimizer param group."""
        self.config, self.comm = config, comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.reduce_dtype = config.precision.reduce_dtype
        # See [Note: reducing a bucket to a shard]
        self.reduce_scatter = config.reduce_scatter if config.reduce_scatter is not None else comm.backend != "gloo"
        keys, bucket_numel = self.bucket_keys(model, params, groups)
        self.layout = build_layout([(p.numel(), key) for p, key in zip(params, keys)],
                                   world_size=self.world_size if self.shards_optimizer else 1,
                                   bucket_numel=bucket_numel)
        self.group_of_bucket = [groups[b.slots[0].param_index] for b in self.layout.buckets]
        self.flat = FlatParameters(params, self.layout, config.precision.param_dtype)
        self.separate_masters = self.flat.dtype != torch.float32
        self.masters = self.place_parameters()
        self.piece_numel = config.sub_group_size or OPTIMIZER_PIECE_NUMEL.get(self.flat.device.type, sys.maxsize)
        self.pieces = [_split(master, self.piece_numel) for master in self.masters]
        pieces_by_group: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
        for group, pieces in zip(self.group_of_bucket, self.pieces):
            pieces_by_group[group].extend(pieces)
        self.optimizer = rebuild_optimizer(optimizer, pieces_by_group)

    def bucket_keys(self, model: nn.Module, params: list[nn.Parameter], groups: list[int]) -> tuple[list[int], int]:
        """Parameters with the same key may share a bucket, and a bucket holds about this many elements.
        Stages 0-2: one key per optimizer param group, buckets of reduce_bucket_bytes."""
        element_bytes = torch.empty((), dtype=self.reduce_dtype).element_size()
        return groups, max(1, self.config.reduce_bucket_bytes // element_bytes)

    # --- what a subclass provides -------------------------------------------------------------
    def place_parameters(self) -> list[nn.Parameter]:
        """Move the parameters into the flat buffer and return one fp32 master per bucket.

        Masters come from the parameters as given (fp32), before the cast to a 16-bit param dtype, so
        mixed precision starts from exactly the user's weights, not from their bf16 rounding."""
        full_precision = self.flat.pack()
        self.flat.adopt(full_precision)
        return [self._make_master(full_precision, bucket) for bucket in self.layout.buckets]

    def prepare_backward(self) -> None:
        """Called before every backward."""

    def finish_backward(self) -> None:
        """Called after every backward, once its reductions are done."""

    def on_grad_ready(self, param_index: int) -> None:
        """params[param_index]'s gradient for this backward is complete (autograd hook)."""

    def reduce_bucket(self, bucket: Bucket) -> BucketReduction:
        raise NotImplementedError

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        """The reduced gradient of the slice of `bucket` this rank updates (param or reduce dtype)."""
        raise NotImplementedError

    def zero_grads(self) -> None:
        raise NotImplementedError

    def gradient_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------------------
    def reduce_to_shard(self, bucket: Bucket, full: torch.Tensor) -> Pending:
        """Average `full` (1-D, the whole bucket, reduce dtype; this rank may overwrite it) across ranks.
        Once waited on, the Pending's output is this rank's shard of the average: a new tensor after a
        reduce-scatter, a view of `full` after an all-reduce. See [Note: reducing a bucket to a shard]."""
        if self.reduce_scatter:
            shard = torch.empty(bucket.shard_numel, dtype=full.dtype, device=full.device)
            return self.comm.reduce_scatter(shard, full, async_op=True)
        pending = self.comm.all_reduce(full, async_op=True)
        begin = self.rank * bucket.shard_numel
        return Pending(full[begin:begin + bucket.shard_numel], pending.work)

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.shard_range(self.rank) if self.shards_optimizer else (bucket.start, bucket.end)

    def _make_master(self, full_precision: torch.Tensor, bucket: Bucket) -> nn.Parameter:
        begin, end = self.owned_range(bucket)
        if self.separate_masters:
            return nn.Parameter(full_precision[begin:end].clone())
        # fp32 training updates the flat buffer in place: See [Note: flat buffer aliasing].
        return nn.Parameter(self.flat.buffer[begin:end])

    def attach_master_grads(self) -> list[torch.Tensor]:
        """Give each master its fp32 gradient (a transient copy only if gradients are 16-bit), piece by
        piece (See [Note: optimizer pieces]); returns one gradient tensor per master."""
        grads = []
        for bucket, pieces in zip(self.layout.buckets, self.pieces):
            grad = self.owned_grad(bucket)
            grad = grad if grad.dtype == torch.float32 else grad.float()
            for piece, piece_grad in zip(pieces, grad.split(self.piece_numel)):
                piece.grad = piece_grad
            grads.append(grad)
        return grads

    def release_grads(self) -> None:
        for pieces in self.pieces:
            for piece in pieces:
                piece.grad = None
        self.zero_grads()

    def publish_params(self) -> None:
        """After the optimizer step: masters -> compute-dtype params, then all-gather the shards."""
        if self.separate_masters:
            for bucket, master in zip(self.layout.buckets, self.masters):
                begin, end = self.owned_range(bucket)
                self.flat.buffer[begin:end].copy_(master.detach())
        if self.shards_optimizer:
            buffer = self.flat.buffer
            pending = [self.comm.all_gather(bucket_view(buffer, b), shard_view(buffer, b, self.rank), async_op=True)
                       for b in self.layout.buckets]
            for item in pending:
                wait(item)

    def write_back_params(self) -> None:
        """The user changed parameters in place: make the fp32 masters agree (they are views in fp32)."""
        if self.separate_masters:
            for bucket, master in zip(self.layout.buckets, self.masters):
                begin, end = self.owned_range(bucket)
                copy_edits(master.data, self.flat.buffer[begin:end])

    @contextmanager
    def gathered(self, units: Any = None, write_back: bool = False) -> Iterator[None]:
        """Stages 0-2 always hold full parameters; only edits need handing back to the masters."""
        try:
            yield
        finally:
            if write_back:
                self.write_back_params()

    def units_of(self, params: list[nn.Parameter]) -> None:
        return None

    def saving_plan(self, model: nn.Module) -> list[tuple[Any, list[nn.Parameter]]]:
        """What to gather together when saving: (units, their parameters); here all at once."""
        return [(None, list(model.parameters()))]

    def frozen_bytes(self, model: nn.Module) -> int:
        """Bytes this rank holds for the frozen parameters (requires_grad=False) of `model`: stages 0-2
        keep them whole, in the compute dtype."""
        trainable = {id(p) for p in self.flat.params}
        return tensor_bytes(p for p in model.parameters() if id(p) not in trainable)

    def memory_by_category(self) -> dict[str, int]:
        """Bytes this rank holds for trainable parameters, their gradients and optimizer state."""
        state = [t for per_param in self.optimizer.state.values() for t in per_param.values()]
        masters = self.masters if self.separate_masters else []
        return {
            "parameters": tensor_bytes([self.flat.buffer]),
            "gradients": tensor_bytes(self.gradient_tensors()),
            "optimizer_state": tensor_bytes(masters) + tensor_bytes(state),
        }
