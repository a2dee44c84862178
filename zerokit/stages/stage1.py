"""Stage 1: shard the optimizer state. Gradients are still accumulated in full on every rank, then
reduce-scattered once per optimizer step so each rank receives the averaged gradient of the shard it
owns, steps its fp32 master shard, and the updated parameters are all-gathered."""

from __future__ import annotations

import torch

from zerokit.flat import Bucket, bucket_view
from zerokit.stages.base import BucketReduction
from zerokit.stages.stage0 import DataParallel


class ShardedOptimizerState(DataParallel):
    shards_optimizer = True

    def reduce_bucket(self, bucket: Bucket) -> BucketReduction:
        grads = bucket_view(self.grad_buffer, bucket).to(self.reduce_dtype)
        shard = torch.empty(bucket.shard_numel, dtype=self.reduce_dtype, device=grads.device)
        self.reduced[bucket.index] = shard
        return BucketReduction(self.comm.reduce_scatter(shard, grads, async_op=True), None, grads)

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        return self.reduced[bucket.index]
