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

from zerokit.flat.layout import Bucket, FlatLayout, Slot


class FlatParameters:
    """Parameters laid out in buckets (see layout.py): packed into, or pointed at, flat 1-D buffers."""

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

    def pack_bucket(self, bucket: Bucket) -> torch.Tensor:
        """The current values of one bucket's parameters as a new 1-D fp32 tensor, padding zeroed."""
        packed = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
        for slot in bucket.slots:
            begin, end = bucket.slot_range(slot)
            packed[begin:end].copy_(self.params[slot.param_index].data.reshape(-1))
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
                views[slot.param_index] = buffer[slot.offset:slot.offset + slot.numel].view(self._shape(slot))
        return views  # type: ignore[return-value]

    def point(self, bucket: Bucket, full: torch.Tensor) -> None:
        """Make the bucket's parameters views of `full`, the bucket's values alone (1-D)."""
        for slot in bucket.slots:
            begin, end = bucket.slot_range(slot)
            self.params[slot.param_index].data = full[begin:end].view(self._shape(slot))

    def release(self, bucket: Bucket, placeholder: torch.Tensor) -> None:
        """Every parameter of the bucket becomes `placeholder` (one element) broadcast to its shape."""
        for slot in bucket.slots:
            self.params[slot.param_index].data = placeholder.expand(self._shape(slot))

    def new_buffer(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(self.layout.numel, dtype=dtype or self.dtype, device=self.device)

    def _shape(self, slot: Slot) -> torch.Size:
        return self.params[slot.param_index].shape


def bucket_view(buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """The bucket in a flat buffer of the whole layout."""
    return buffer[bucket.start:bucket.end]


def shard_view(buffer: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
    """Rank's shard of the bucket in a flat buffer of the whole layout."""
    begin, end = bucket.shard_range(rank)
    return buffer[begin:end]


def own_part(bucket_values: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
    """Rank's shard of a tensor that holds the bucket alone."""
    begin, end = bucket.shard_in_bucket(rank)
    return bucket_values[begin:end]


def copy_edits(master: torch.Tensor, compute: torch.Tensor) -> None:
    """Copy into the fp32 `master` only the elements whose 16-bit `compute` copy no longer matches it:
    copying all of them would round every untouched master weight to 16 bits."""
    edited = compute != master.to(compute.dtype)
    master[edited] = compute[edited].to(master.dtype)


def tensor_bytes(tensors) -> int:
    """Bytes held by the tensors among `tensors` (other items are ignored: optimizer state has ints)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
