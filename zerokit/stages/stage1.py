"""Stage 1: shard the optimizer state. Gradients are still accumulated in full on every rank, then
reduced once per optimizer step so each rank receives the averaged gradient of the shard it owns
(See [Note: reducing a bucket to a shard]), steps its fp32 master shard, and the updated parameters
are all-gathered."""

from __future__ import annotations

import torch

from zerokit.comm import Reduction
from zerokit.flat import Bucket, bucket_view, shard_view
from zerokit.stages.stage0 import DataParallel


class ShardedOptimizerState(DataParallel):
    shards_optimizer = True

    def reduce_bucket(self, bucket: Bucket) -> Reduction:
        grads = bucket_view(self.grad_buffer, bucket)  # 1-D, the whole bucket, param dtype
        if grads.dtype == self.reduce_dtype:
            # The averaged shard goes back into the gradient buffer: no second gradient copy is held.
            owned = shard_view(self.grad_buffer, bucket, self.rank)
            return self.averaging.to_shard(bucket, grads, lambda shard: _copy_unless_same(owned, shard))
        full = grads.to(self.reduce_dtype)  # a copy, whole bucket

        def keep_shard(shard: torch.Tensor) -> None:  # in reduce dtype until the step; never a view of `full`
            self.reduced[bucket.index] = shard.clone() if _same_storage(shard, full) else shard
        return self.averaging.to_shard(bucket, full, keep_shard)

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        return self.reduced.get(bucket.index, shard_view(self.grad_buffer, bucket, self.rank))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _copy_unless_same(destination: torch.Tensor, source: torch.Tensor) -> None:
    """After an all-reduce in place the shard is already where it belongs."""
    if destination.data_ptr() != source.data_ptr():
        destination.copy_(source)
