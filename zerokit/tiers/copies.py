"""Copies between the device and host memory on a stream of their own, so that they overlap the compute that the
device's default stream runs (issue 34).

[Note: a gradient's copy to the host]
An offloaded master's gradient shard is copied to its pinned host buffer as soon as its bucket's last reduction of
the window is done (zerokit/tiers/homes.py, HostHome.accept_grad), and the device's shard is let go of right then
(ShardedGradients._accept_grad), so that an offload user's GPU holds no fp32 gradient shards beyond the buckets in
flight (DeepSpeed moves its partitions to pinned host memory alike). On CUDA the copy runs on the copy stream: it
waits for what the default stream has issued (the reduction's result), and the shard's memory is marked as used by
the copy stream (`record_stream`), so that the allocator hands it out again only once the copy is done; the optimizer
step waits for the copy's event. Without CUDA the copy is synchronous: the same path, counted the same, nothing to
overlap.

[Note: a parameter shard fetched ahead]
A stage-3 shard in host memory is copied into its slot of the bucket being gathered and gathered from there
(zerokit/tiers/shards.py). The copy and the gather are issued on the copy stream (`on_copy_stream`), so that a
prefetch, issued while the unit before it computes, overlaps that unit's kernels instead of queueing in front of
them on the default stream; the all-gather waits for the copy (NCCL orders a collective after the stream it is
issued on), and the unit that uses the bucket waits for the gather as it does for any other.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_streams: dict[int, torch.cuda.Stream] = {}  # device index -> its copy stream, made on first use


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's copy stream (one for the process, as the copies of every engine queue on it in order)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]


def copy_to_host(host: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event | None:
    """Start copying `source` (device) into `host` (pinned): on the copy stream on CUDA, returning the event the
    reader waits for; at once elsewhere (None). See [Note: a gradient's copy to the host]."""
    if not source.is_cuda:
        host.copy_(source)
        return None
    stream = copy_stream(source.device)
    stream.wait_stream(torch.cuda.current_stream(source.device))
    with torch.cuda.stream(stream):
        host.copy_(source, non_blocking=True)
        source.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return done


@contextmanager
def on_copy_stream(device: torch.device) -> Iterator[None]:
    """What is issued inside runs on the device's copy stream, after all the default stream has issued (nothing
    changes off CUDA). See [Note: a parameter shard fetched ahead]."""
    if device.type != "cuda":
        yield
        return
    stream = copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
