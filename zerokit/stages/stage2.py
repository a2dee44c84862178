"""Stage 2: shard the gradients too. No full gradient buffer exists: as each parameter's gradient
arrives it is added into its bucket's staging buffer and freed; a full bucket is reduce-scattered
(asynchronously, while backward goes on; See [Note: reducing a bucket to a shard]) and each rank
keeps only the shard it owns."""

from __future__ import annotations

import torch

from zerokit.flat import Bucket, Slot
from zerokit.stages.base import BucketReduction, ZeroStage


class ShardedGradients(ZeroStage):
    shards_optimizer = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reduces_every_micro_step = self.config.reduce_every_micro_step
        # 1-D, reduce dtype: this rank's shard of every bucket, back to back (bucket b at b.start / N).
        # Micro-steps accumulate here, so fp32 (the default reduce dtype) keeps accumulation exact.
        self.grad_shards = torch.zeros(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.flat.device)
        self.staging: dict[int, torch.Tensor] = {}  # bucket index -> 1-D full bucket, reduce dtype
        self.place: dict[int, tuple[Bucket, Slot]] = {
            slot.param_index: (bucket, slot) for bucket in self.layout.buckets for slot in bucket.slots}

    def _staging_for(self, bucket: Bucket) -> torch.Tensor:
        if bucket.index not in self.staging:
            self.staging[bucket.index] = torch.zeros(bucket.numel, dtype=self.reduce_dtype, device=self.flat.device)
        return self.staging[bucket.index]

    def on_grad_ready(self, param_index: int) -> None:
        param = self.flat.params[param_index]
        if param.grad is None:  # no gradient this step: its share of the bucket stays zero
            return
        bucket, slot = self.place[param_index]
        begin = slot.offset - bucket.start
        self._staging_for(bucket)[begin:begin + slot.numel].add_(param.grad.reshape(-1))
        param.grad = None  # the full gradient is freed as soon as it is staged

    def reduce_bucket(self, bucket: Bucket) -> BucketReduction:
        staging = self._staging_for(bucket)
        del self.staging[bucket.index]
        pending = self.reduce_to_shard(bucket, staging)
        owned = self.owned_grad(bucket)
        return BucketReduction(pending, lambda: owned.add_(pending.output), staging)

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        begin = bucket.start // self.world_size
        return self.grad_shards[begin:begin + bucket.shard_numel]

    def zero_grads(self) -> None:
        self.grad_shards.zero_()

    def gradient_tensors(self) -> list[torch.Tensor]:
        # Full gradients exist only while micro-steps accumulate locally (reduce_every_micro_step=False).
        accumulating = [p.grad for p in self.flat.params if p.grad is not None]
        return [self.grad_shards, *self.staging.values(), *accumulating]
