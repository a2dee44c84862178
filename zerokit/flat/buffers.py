"""Flat buffers: the model's trainable parameters become views into one contiguous 1-D buffer.

[Note: flat buffer aliasing]
`param.data` is re-pointed at a view of `FlatParameters.buffer`, so the module computes with the
flat buffer's memory and an in-place update of a buffer slice (an optimizer step on a shard, or an
all-gather) is the parameter update: no copy back. Gradients use the same trick where a stage keeps
full gradients: `param.grad` is set to a view of a flat gradient buffer, and autograd accumulates into
an existing `.grad` in place, so a bucket of the gradient buffer is ready to reduce with no copy.
"""

from __future__ import annotations

import torch
from torch import nn

from zerokit.flat.layout import Bucket, FlatLayout


class FlatParameters:
    """One flat buffer (1-D, padded per bucket) holding every trainable parameter of the model."""

    def __init__(self, params: list[nn.Parameter], layout: FlatLayout, dtype: torch.dtype) -> None:
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"trainable parameters must be on one device, got {sorted(map(str, devices))}")
        self.params = params
        self.layout = layout
        self.dtype = dtype
        self.device = params[0].device if params else torch.device("cpu")
        self.buffer = torch.empty(0, dtype=dtype, device=self.device)  # 1-D, all buckets, once adopted

    def pack(self) -> torch.Tensor:
        """Copy the parameters' current values into a new fp32 flat buffer (for the master weights)."""
        packed = self.new_buffer(torch.float32)
        for param, view in zip(self.params, self.views(packed)):
            view.copy_(param.data)
        return packed

    def adopt(self, values: torch.Tensor) -> None:
        """Make `values` (cast to the param dtype) the buffer and every parameter a view of it."""
        self.buffer = values.to(self.dtype)
        for param, view in zip(self.params, self.views(self.buffer)):
            param.data = view  # See [Note: flat buffer aliasing]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of `buffer` shaped like each parameter, in parameter order."""
        views: list[torch.Tensor | None] = [None] * len(self.params)
        for bucket in self.layout.buckets:
            for slot in bucket.slots:
                shape = self.params[slot.param_index].shape
                views[slot.param_index] = buffer[slot.offset:slot.offset + slot.numel].view(shape)
        return views  # type: ignore[return-value]

    def new_buffer(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(self.layout.numel, dtype=dtype or self.dtype, device=self.device)


def bucket_view(buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    return buffer[bucket.start:bucket.end]


def shard_view(buffer: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
    begin, end = bucket.shard_range(rank)
    return buffer[begin:end]
