"""Stage 2: shard the gradients too. No full gradient buffer exists: as each parameter's gradient
arrives it is added into its bucket's staging buffer and freed; a full bucket is reduce-scattered
(asynchronously, while backward goes on; See [Note: reducing a bucket to a shard]) and each rank
keeps only the shard it owns."""

from __future__ import annotations

import torch

from zerokit.comm import ProcessGroups, Reduction
from zerokit.flat import Bucket, FlatParameters, Slot
from zerokit.masters import ShardMasters
from zerokit.config.settings import EngineSettings, StageSettings
from zerokit.stages.base import ZeroStage


class ShardedGradients(ZeroStage):
    shards_optimizer = True

    def __init__(self, flat: FlatParameters, masters: ShardMasters, groups: ProcessGroups, part: StageSettings,
                 settings: EngineSettings) -> None:
        super().__init__(flat, masters, groups, part, settings)
        # bucket index -> 1-D, reduce dtype: this rank's shard of the bucket's reduced gradient. Micro-steps
        # accumulate here, so fp32 (the default reduce dtype) keeps accumulation exact. Each is made at the bucket's
        # first reduction in a window and let go of at its step: See [Note: gradients live from a window's first
        # backward to its step] in stages/base.py.
        self.local = self.layout.shards_of(self.rank)
        self.grad_shards: dict[int, torch.Tensor] = {}
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
        begin, end = bucket.slot_range(slot)
        self._staging_for(bucket)[begin:end].add_(param.grad.reshape(-1))
        param.grad = None  # the full gradient is freed as soon as it is staged

    def reduce_bucket(self, bucket: Bucket) -> Reduction:
        staging = self._staging_for(bucket)
        del self.staging[bucket.index]
        owned = self.owned_grad(bucket)
        return self.averaging.to_shard(bucket, staging, owned.add_)

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        if bucket.index not in self.grad_shards:  # the bucket's first reduction in this window
            begin, end = self.local.ranges[bucket.index]
            self.grad_shards[bucket.index] = torch.zeros(end - begin, dtype=self.reduce_dtype, device=self.flat.device)
        return self.grad_shards[bucket.index]

    def _accept_grad(self, bucket: Bucket) -> None:
        super()._accept_grad(bucket)
        if self.masters.homes[bucket.index].copies_grad:  # See [Note: a gradient's copy to the host]
            del self.grad_shards[bucket.index]

    def zero_grads(self) -> None:
        self.grad_shards = {}
        self.staging.clear()  # empty after a window's last reduction; full of unreduced ones when one is dropped

    def gradient_tensors(self) -> list[torch.Tensor]:
        # Full gradients exist only while micro-steps accumulate locally (reduce_every_micro_step=False).
        accumulating = [p.grad for p in self.flat.params if p.grad is not None]
        return [*self.grad_shards.values(), *self.staging.values(), *accumulating]
