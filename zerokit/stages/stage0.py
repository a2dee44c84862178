"""Stage 0: plain data parallel. Every rank keeps full parameters, gradients and optimizer state;
gradients are all-reduced bucket by bucket. The baseline every other stage is measured against."""

from __future__ import annotations

import torch

from zerokit.comm import Reduction
from zerokit.flat import Bucket, bucket_view
from zerokit.stages.base import ZeroStage


class DataParallel(ZeroStage):
    shards_optimizer = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # 1-D, param dtype (See [Note: flat buffer aliasing]); at stage 0 one usage flag per parameter follows
        # the last bucket and is all-reduced with it (See [Note: parameters no rank used]).
        self.grad_numel = self.layout.numel + (0 if self.shards_optimizer else len(self.flat.params))
        # See [Note: gradients live from a window's first backward to its step] in stages/base.py
        self.grad_buffer: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []  # each parameter's view of grad_buffer, made with it
        # bucket index -> reduced gradient (reduce dtype), held from backward to the optimizer step
        # when it cannot live in grad_buffer (another dtype; or a shard, since gloo cannot reduce-scatter
        # in place). Keeping it in reduce dtype is what makes an fp32 reduction worth doing.
        self.reduced: dict[int, torch.Tensor] = {}

    def prepare_backward(self) -> None:
        if self.grad_buffer is None:  # a window's first backward
            self.grad_buffer = torch.zeros(self.grad_numel, dtype=self.flat.dtype, device=self.flat.device)
            self.grad_views = self.flat.views(self.grad_buffer)
        # Re-attach every time: a user's zero_grad(set_to_none=True) would otherwise detach the views.
        for param, view in zip(self.flat.params, self.grad_views):
            param.grad = view

    def reduce_bucket(self, bucket: Bucket) -> Reduction:
        carries_flags = bucket.index == len(self.layout.buckets) - 1
        grads = self.grad_buffer[bucket.start:None if carries_flags else bucket.end]
        if carries_flags:
            grads[bucket.numel:].copy_(self.usage.flags(grads.dtype, grads.device))
        if grads.dtype != self.reduce_dtype:
            grads = grads.to(self.reduce_dtype)
            self.reduced[bucket.index] = grads[:bucket.numel]

        def then(reduced: torch.Tensor) -> None:  # usage flags are summed or averaged alike: only > 0 matters
            if carries_flags:
                self.usage.agree(reduced[bucket.numel:])
        return self.averaging.whole(bucket, grads, then)  # See [Note: gradient pre-division]

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        return self.reduced.get(bucket.index, bucket_view(self.grad_buffer, bucket))

    def zero_grads(self) -> None:
        for param in self.flat.params:  # the views go with the buffer, as zero_grad(set_to_none=True) leaves them
            param.grad = None
        self.grad_buffer, self.grad_views = None, []
        self.reduced.clear()

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [*([self.grad_buffer] if self.grad_buffer is not None else []), *self.reduced.values()]
