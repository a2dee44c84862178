"""What a step really holds, measured: the bytes autograd saves for backward (per block and outside the
blocks), the allocator's peak, and the process's resident peak.

[Note: counting saved activations]
`torch.autograd.graph.saved_tensors_hooks` sees every tensor an op saves for backward. We count each
distinct storage once, whole (a saved view keeps its whole storage alive), and leave out parameters and
module buffers, which are model state whatever saves them (at stage 3 a saved weight is the parameter
object, whose storage is the gathered unit). A storage is attributed to the block that was running when
it was first saved, or to "outside" (embeddings, head, loss). Activation checkpointing installs hooks of
its own inside the checkpointed region; only the innermost hooks see a tensor, so a checkpointed block's
saved input is what we count there, as it should be.

[Note: the allocator's peak on the CPU]
CUDA keeps max_memory_allocated; the CPU allocator keeps nothing, but with the profiler's memory
recording on it reports every allocation and free. Summing them in time order gives the peak growth of
allocated bytes over the window (frees of blocks allocated before the window are not reported and so not
subtracted: the peak is over what the window allocated). The profiler slows the step, so a recorder
measures times and resident memory in other steps.

[Note: counting the all-to-alls no communicator counts]
The expert exchange (zerokit/parallel/experts/dispatch.py) calls torch.distributed.all_to_all_single itself, so
comm_stats() never sees it. The profiler does: each call is a c10d::alltoall_base_ op whose recorded input shapes
(record_shapes) give the tensor this rank sends, the logical size as comm_stats() counts a collective. Only floating
inputs are counted, the tokens and their gradients; a dropless exchange's integer routing counts (E int64 per MoE
layer and forward) only size the exchange.
"""

from __future__ import annotations

import gc
import math
import resource
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.autograd.profiler import record_function

OUTSIDE = -1  # block index of what is saved outside the repeated blocks


class SavedTensorCounter:
    """Context manager: bytes autograd saves while it is open, by block. See [Note: counting saved activations]."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module] = ()) -> None:
        self.model = model
        self.blocks = list(blocks)
        self.current: list[int] = [OUTSIDE]
        self.by_storage: dict[int, tuple[int, int]] = {}  # storage pointer -> (block index, bytes)
        self._hooks: list = []
        self._context = None

    def _excluded(self) -> set[int]:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return {t.untyped_storage().data_ptr() for t in tensors if t.device.type != "meta"}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if storage.nbytes() and pointer not in self.by_storage and pointer not in self._excluded():
                self.by_storage[pointer] = (self.current[-1], storage.nbytes())
        return tensor

    def _enter_block(self, index: int, *_: object) -> None:
        self.current.append(index)

    def _leave_block(self, *_: object) -> None:  # a hook that returned something would replace the output
        self.current.pop()

    def __enter__(self) -> SavedTensorCounter:
        for index, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(partial(self._enter_block, index)))
            self._hooks.append(block.register_forward_hook(self._leave_block))
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @property
    def total(self) -> int:
        return sum(size for _, size in self.by_storage.values())

    def per_block(self) -> list[int]:
        sizes = [0] * len(self.blocks)
        for block, size in self.by_storage.values():
            if block != OUTSIDE:
                sizes[block] += size
        return sizes

    @property
    def outside(self) -> int:
        return sum(size for block, size in self.by_storage.values() if block == OUTSIDE)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


ALL_TO_ALL_OP = "c10d::alltoall_base_"
FLOATING_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2}
"""Bytes per element of the floating dtypes, by the names the profiler records an op's input types with."""


@contextmanager
def all_to_all_counts() -> Iterator[dict[str, int]]:
    """Yields a dict that holds, on exit, the calls, elements and bytes of the floating all-to-alls issued inside the
    block (See [Note: counting the all-to-alls no communicator counts])."""
    from torch.profiler import ProfilerActivity, profile

    counts = {"calls": 0, "elements": 0, "bytes": 0}
    profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    with profiler:
        yield counts
    for event in profiler.profiler.kineto_results.events():
        if event.name() != ALL_TO_ALL_OP or event.dtypes()[1] not in FLOATING_BYTES:
            continue
        sent = math.prod(event.shapes()[1])  # the input: (output, input, group, split sizes, ...)
        counts["calls"] += 1
        counts["elements"] += sent
        counts["bytes"] += sent * FLOATING_BYTES[event.dtypes()[1]]


PHASES = ("forward", "head", "blocks", "tail")
"""Where backward's peak can fall: forward (and the loss); backward of the loss and head, before any
block; the blocks; after the first block (embeddings, the gradient reductions still finishing)."""


class AllocationTimeline:
    """Context manager: the peak growth of allocated bytes inside it, overall and per phase of a
    forward-backward; `mark(phase)` starts a phase. See [Note: the allocator's peak on the CPU]."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self.end = 0
        self.phase_peaks: dict[str, int] = {}
        self._profiler = None
        self._start = 0
        self._cuda_marks: list[tuple[str, int]] = []

    def mark(self, phase: str) -> None:
        if self.device.type == "cuda":
            self._cuda_marks.append((phase, torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with record_function(f"zerokit::phase::{phase}"):
            pass

    def __enter__(self) -> AllocationTimeline:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._cuda_marks = [("forward", 0)]
            return self
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        self.mark("forward")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            marks = self._cuda_marks[1:] + [("end", torch.cuda.max_memory_allocated(self.device))]
            self.phase_peaks = {name: peak - self._start for (name, _), (_, peak) in zip(self._cuda_marks, marks)}
            self.peak = max(self.phase_peaks.values())
            self.end = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._profiler.__exit__(*exc)
        self._summarise(self._profiler.profiler.kineto_results.events())
        self._profiler = None

    def _summarise(self, events) -> None:
        timeline = []  # (time, bytes change, phase name or None)
        for event in events:
            name = event.name()
            if name == "[memory]" and str(event.device_type()).endswith("CPU"):
                timeline.append((event.start_ns(), event.nbytes(), None))
            elif name.startswith("zerokit::phase::"):
                timeline.append((event.start_ns(), 0, name.rsplit("::", 1)[1]))
        running, phase = 0, "forward"
        peaks = {phase: 0}
        for _, change, mark in sorted(timeline, key=lambda item: item[0]):
            if mark is not None:
                phase = mark
                peaks[phase] = max(peaks.get(phase, 0), running)
            running += change
            peaks[phase] = max(peaks[phase], running)
        self.phase_peaks, self.peak, self.end = peaks, max(peaks.values()), running


def status_bytes(field: str) -> int:
    """A byte count of this process's /proc/self/status (Linux): VmRSS, VmHWM and the like, read from the kernel rather
    than from our own counters."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def resident_bytes() -> int:
    """This process's resident set now (Linux), or its high-water mark where /proc is missing."""
    try:
        return status_bytes("VmRSS")
    except (OSError, RuntimeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextmanager
def resident_peak() -> Iterator[dict[str, int]]:
    """Yields a dict that holds, on exit, `peak` (the resident high-water mark inside the block, reset at
    its start through /proc/self/clear_refs) and `start` (resident bytes at its start)."""
    gc.collect()
    result = {"start": resident_bytes(), "peak": 0, "reset": 1}
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        result["reset"] = 0  # the mark then covers the whole process life: an upper bound
    try:
        yield result
    finally:
        try:
            result["peak"] = status_bytes("VmHWM")
        except (OSError, RuntimeError):
            result["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextmanager
def backward_phases(blocks: Sequence[nn.Module], timeline: AllocationTimeline) -> Iterator[None]:
    """Mark `blocks` and `tail` in `timeline` as backward reaches the last block and leaves the first
    (tensor hooks on the last block's output and the first block's input, set in forward). The caller
    marks `head` when the loss is computed."""
    if not blocks:
        yield
        return

    def on_output(module: nn.Module, args: tuple, output: object) -> None:
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(lambda grad: timeline.mark("blocks"))

    def on_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        candidates = [*args, *kwargs.values()]
        tensor = next((t for t in candidates if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if tensor is not None:
            tensor.register_hook(lambda grad: timeline.mark("tail"))

    handles = [blocks[-1].register_forward_hook(on_output),
               blocks[0].register_forward_pre_hook(on_input, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
