"""How a bucket of gradients is averaged across ranks: divided before the sum as DeepSpeed's pre-division asks,
reduced to this rank's shard (or all-reduced whole at stage 0), and with MiCS averaged across the replicas once
backward is done. *When* a bucket is reduced is the reducer's (stages/reducer.py); *which* tensor it reduces and
where the result is kept is the stage's; this piece owns only the arithmetic and the collectives in between.

[Note: reducing a bucket to a shard]
Stages 1-3 need only this rank's shard of each averaged gradient bucket. A reduce-scatter gives just
that and sends half the bytes of an all-reduce, so it is the default wherever the back-end implements
it well (NCCL). gloo does not: for a 25 MiB fp32 bucket on 2 ranks here, its reduce-scatter took
32 ms and allocated a second full-size copy, its all-reduce 14 ms in place. So on gloo the bucket,
which this rank already holds whole, is all-reduced in place and the shard is read from it: no more
memory, less time, and counted honestly as an all-reduce. `zero_optimization.reduce_scatter` forces
either choice.

[Note: gradient pre-division]
Gradients are averaged over ranks by default: summed, then divided by N (gloo's AVG does exactly that). A
16-bit sum of N gradients can overflow where their average would not (two fp16 60000s sum to inf), so
DeepSpeed offers to divide first: `prescale_gradients` divides by N before the sum; `gradient_predivide_factor`
f divides by f before it and multiplies the sum by f/N after. zerokit does the same arithmetic, in the
reduce dtype, with a SUM collective: (sum of g/f) x f/N. Dividing and multiplying by a power of two is exact
(short of underflow), so with f and N powers of two the result is bit-identical to the plain average
(tests/test_deepspeed_engine_blocks.py checks it); otherwise it differs by rounding only.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from zerokit.comm import Pending, ProcessGroups, Reduction, wait
from zerokit.flat import Bucket
from zerokit.config.settings import EngineSettings, StageSettings

Purpose = Callable[[Bucket], str]
"""What a bucket's reduction is for, as failure reports name it (the stage's bucket_purpose)."""


class BucketAveraging:
    def __init__(self, groups: ProcessGroups, part: StageSettings, settings: EngineSettings, purpose: Purpose) -> None:
        self.comm, self.replica_comm = groups.shard, groups.replica  # See [Note: hybrid sharding] in comm/groups.py
        self.rank, self.world_size = self.comm.rank, self.comm.world_size  # in the shard group
        self.reduce_scatter = settings.reduce_scatter  # See [Note: reducing a bucket to a shard]
        # See [Note: gradient pre-division]: what gradients are divided by before their sum (1: averaged as usual)
        self.predivide = float(settings.world_size) if part.prescale_gradients else part.gradient_predivide_factor
        # a stage of experts split over ep ranks: its group's sum holds 1/ep of the job's gradient, so one process's
        # average is the group's divided by ep more (See [Note: ZeRO over experts split across ranks])
        self.expert_share = 1.0 / settings.expert_degree
        self.purpose = purpose
        self.awaiting_replicas: list[Bucket] = []  # reduced in the shard group, not yet across the replicas

    def to_shard(self, bucket: Bucket, full: torch.Tensor, then: Callable[[torch.Tensor], None]) -> Reduction:
        """Average `full` (1-D, the whole bucket, reduce dtype; this rank may overwrite it) across the shard group,
        then call `then` with this rank's shard of the average: a new tensor after a reduce-scatter, a view of
        `full` after an all-reduce. See [Note: reducing a bucket to a shard]."""
        begin, end = bucket.shard_in_bucket(self.rank)
        op, after = self.predivide_(full)
        purpose = self.purpose(bucket)
        if not self.reduce_scatter:
            pending = Pending(full[begin:end], self.comm.all_reduce(full, op=op, async_op=True, purpose=purpose).work)
        elif bucket.owner is not None:  # See [Note: buckets owned by one rank]
            pending = Pending(full[begin:end], self.comm.reduce(full, dst=bucket.owner, op=op, async_op=True,
                                                             purpose=purpose).work)
        else:
            shard = torch.empty(end - begin, dtype=full.dtype, device=full.device)
            pending = self.comm.reduce_scatter(shard, full, op=op, async_op=True, purpose=purpose)
        return Reduction(pending, _multiplied_then(after, slice(None), then), keep_alive=full)

    def whole(self, bucket: Bucket, grads: torch.Tensor, then: Callable[[torch.Tensor], None]) -> Reduction:
        """Stage 0: all-reduce `grads` (1-D, reduce dtype; its first bucket.numel elements the bucket's gradients,
        anything after them summed as it is, as stage 0's usage flags are) and call `then` with all of it."""
        op, after = self.predivide_(grads[:bucket.numel])
        pending = self.comm.all_reduce(grads, op=op, async_op=True, purpose=self.purpose(bucket))
        return Reduction(pending, _multiplied_then(after, slice(0, bucket.numel), then))

    def predivide_(self, grads: torch.Tensor) -> tuple[dist.ReduceOp, float]:
        """Divide `grads` in place before their reduction as DeepSpeed's prescale_gradients /
        gradient_predivide_factor ask; returns the reduction's op and what its result is then multiplied by.
        See [Note: gradient pre-division]."""
        if self.predivide == 1.0:
            return dist.ReduceOp.AVG, self.expert_share
        grads.mul_(1.0 / self.predivide)
        # the replicas then average over the rest
        return dist.ReduceOp.SUM, self.predivide / self.world_size * self.expert_share

    def waits_for_replicas(self, bucket: Bucket) -> bool:
        """With MiCS, a bucket reduced at the accumulation boundary is kept for `average_across_replicas`
        (True); without replicas it is final now (False)."""
        if self.replica_comm is None:
            return False
        self.awaiting_replicas.append(bucket)
        return True

    def average_across_replicas(self, owned_grad: Callable[[Bucket], torch.Tensor],
                                accept: Callable[[Bucket], None]) -> None:
        """Each kept bucket's shard (`owned_grad`), reduced inside the shard group, all-reduced (averaged) over
        the replica group, in bucket order on every rank, then `accept`ed. Nothing without replicas."""
        buckets, self.awaiting_replicas = self.awaiting_replicas, []
        pending = [self.replica_comm.all_reduce(owned_grad(bucket), async_op=True,
                                                purpose=f"{self.purpose(bucket)}, across replicas")
                   for bucket in buckets]
        for bucket, item in zip(buckets, pending):
            wait(item)
            accept(bucket)


def _multiplied_then(after: float, part: slice, then: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """`then`, after multiplying `part` of the reduced tensor by `after` (the second half of a pre-division)."""
    def store(reduced: torch.Tensor) -> None:  # the last link of the chain
        if after != 1.0:
            reduced[part].mul_(after)
        then(reduced)
    return store
