"""The NVMe tier (offload_optimizer.device=nvme, ZeRO-Infinity): a master and its optimizer state live in swap
files and come into host memory one sub-group at a time, for that sub-group's own optimizer step.

[Note: paging a master through a bounded pool]
A master (one bucket's shard, as large as the bucket: a whole stage-3 unit) is divided into sub-groups, as
DeepSpeed divides its optimizer groups: runs of consecutive optimizer pieces of at most `sub_group_size`
elements together (zero_optimization.sub_group_size; unset, NVME_SUB_GROUP_NUMEL), the first from the
master's start, the last to its end (padding included). A piece larger than that (a whole-tensor optimizer
steps whole parameters) is a sub-group of its own. Each sub-group is one record, in a file of its own: the
fp32 values, then every optimizer-state tensor of its pieces (in piece order, keys sorted), each at a 64-byte
boundary, the whole padded to 4096 bytes for direct I/O. A record's layout is learned the first time it is
written back after a step (optimizer state is created at the first step); it grows then. At the step,
sub-groups are paged in one at a time into buffers from a pool of `buffer_count`: while one is stepped the
next buffer_count - 2 (at least one) are read and the one before is written (ShardMasters.step), so host
memory holds at most buffer_count buffers of one sub-group each (See [Note: a bounded pool of swap buffers] in
zerokit/tiers/swap.py), whatever the size of the model or of its buckets. Paged in, the pieces' data and the optimizer's
state entries are views of the buffer; paged out, the pieces point at a zero-stride placeholder and the state
entries are gone, so nothing but the pool holds host memory. A buffer also has room for the sub-group's
fp32 gradient, copied in from its part of the device's reduced (already unscaled and clipped) gradient shard
just before the step; the updated values are published to their part of the compute shard right after it,
while the record is in memory.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, NamedTuple

import torch
from torch import nn

from zerokit.comm import CommStats, Transfer
from zerokit.flat.buffers import copy_edits
from zerokit.tiers.homes import HeldGradient, ShardIO
from zerokit.tiers.swap import BufferPool, SwapDirectory, round_up

TENSOR_ALIGN = 64  # bytes: every state tensor starts at such a boundary (any dtype's alignment)


class StateEntry(NamedTuple):
    piece: int  # within its sub-group
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the record's start


class SubGroup:
    """One record of a paged master: pieces `pieces` (indices into the master's pieces), covering master
    elements [begin, end)."""

    def __init__(self, file: str, begin: int, end: int, pieces: range) -> None:
        self.file, self.begin, self.end, self.pieces = file, begin, end, pieces
        self.numel = end - begin
        self.layout: list[StateEntry] = []
        self.scalars: dict[tuple[int, str], Any] = {}  # state values that are not tensors
        self.record_bytes = round_up(4 * self.numel)
        self.buffer: torch.Tensor | None = None  # while paged in (or being read)
        self.reading: Future | None = None

    @property
    def buffer_bytes(self) -> int:
        """The record, and room for the fp32 gradient after it."""
        return self.record_bytes + 4 * self.numel

    def values(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:4 * self.numel].view(torch.float32)

    def grad_area(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.record_bytes:self.buffer_bytes].view(torch.float32)

    def state_view(self, buffer: torch.Tensor, entry: StateEntry) -> torch.Tensor:
        return buffer[entry.offset:entry.offset + _nbytes(entry)].view(entry.dtype).view(entry.shape)


def sub_group_spans(pieces: list[tuple[int, int]], numel: int, size: int) -> list[tuple[int, int, range]]:
    """(begin, end, piece indices) of each sub-group of a master of `numel` elements whose pieces span
    `pieces` ([begin, end) each, in order, back to back from 0): runs of pieces of at most `size` elements
    (a larger piece alone), the last one to `numel`. See [Note: paging a master through a bounded pool]."""
    spans, begin, first = [], 0, 0
    for index, (piece_begin, piece_end) in enumerate(pieces):
        if index > first and piece_end - begin > size:
            spans.append((begin, piece_begin, range(first, index)))
            begin, first = piece_begin, index
    if numel:
        spans.append((begin, numel, range(first, len(pieces))))
    return spans


class NvmeHome(HeldGradient):
    """See [Note: paging a master through a bounded pool]."""

    tier = "nvme"
    paged = True

    def __init__(self, compute: torch.Tensor, name: str, swap: SwapDirectory, pool: BufferPool, stats: CommStats,
                 io: ShardIO, sub_group_numel: int) -> None:
        self.compute, self.name, self.swap, self.pool, self.stats, self.io = compute, name, swap, pool, stats, io
        self.numel = compute.numel()
        self.sub_group_numel = sub_group_numel
        self.master = torch.zeros(1).expand(self.numel)  # a placeholder the pieces are cut from; no memory
        self.sub_groups: list[SubGroup] = []

    def divide(self, pieces: list[tuple[int, int]]) -> None:
        """The master's pieces ([begin, end) each) make its sub-groups: ShardMasters calls this once it has cut
        them, before the master is initialised."""
        self.sub_groups = [SubGroup(f"{self.name}.{index}", begin, end, indices) for index, (begin, end, indices)
                           in enumerate(sub_group_spans(pieces, self.numel, self.sub_group_numel))]

    # --- values on the way in and out ---------------------------------------------------------------
    def initialise(self, values: torch.Tensor) -> None:
        for group in self.sub_groups:
            buffer = self.pool.take(group.record_bytes)
            group.values(buffer).copy_(values[group.begin:group.end])
            self._write(group, buffer)
            self.pool.give(buffer)

    def _write(self, group: SubGroup, buffer: torch.Tensor) -> None:
        record = buffer[:group.record_bytes]
        self.swap.write_record(group.file, record)
        self.stats.record(Transfer.NVME_WRITE, record)

    def _read(self, group: SubGroup, buffer: torch.Tensor) -> None:
        record = buffer[:group.record_bytes]
        self.swap.read_record(group.file, record)
        self.stats.record(Transfer.NVME_READ, record)

    # --- paging ------------------------------------------------------------------------------------
    def start_reading(self, sub: int) -> None:
        """Begin reading sub-group `sub`'s record into a pool buffer (returns at once)."""
        group = self.sub_groups[sub]
        group.buffer = self.pool.take(group.buffer_bytes)
        record = group.buffer[:group.record_bytes]
        self.stats.record(Transfer.NVME_READ, record)  # here: the counts are not shared with the I/O threads
        group.reading = self.swap.submit(self.swap.read_record, group.file, record)

    def page_in(self, sub: int, pieces: list[nn.Parameter], offsets: list[int],
                optimizer_of: dict[int, torch.optim.Optimizer], with_grad: bool) -> None:
        """Wait for sub-group `sub`'s read, then point its pieces (`pieces` and `offsets`: the master's) and
        their optimizer state at the buffer; with_grad: also copy this step's gradient in and attach it."""
        group = self.sub_groups[sub]
        if group.reading is None:
            self.start_reading(sub)
        group.reading.result()
        group.reading = None
        mine = [pieces[index] for index in group.pieces]
        values = group.values(group.buffer)
        for piece, index in zip(mine, group.pieces):
            start = offsets[index] - group.begin
            piece.data = values[start:start + piece.numel()].view(piece.shape)
        for entry in group.layout:
            optimizer_of[id(mine[entry.piece])].state[mine[entry.piece]][entry.key] = group.state_view(group.buffer,
                                                                                                        entry)
        for (index, key), value in group.scalars.items():
            optimizer_of[id(mine[index])].state[mine[index]][key] = value
        if with_grad:
            grad = group.grad_area(group.buffer)
            grad.copy_(self.grad32()[group.begin:group.end])
            self.stats.record(Transfer.DEVICE_TO_HOST, grad)
            for piece, index in zip(mine, group.pieces):
                start = offsets[index] - group.begin
                piece.grad = grad[start:start + piece.numel()].view(piece.shape)

    def page_out(self, sub: int, pieces: list[nn.Parameter], optimizer_of: dict[int, torch.optim.Optimizer]) -> None:
        """Write sub-group `sub`'s record back (asynchronously; the buffer returns to the pool when done),
        learning its layout the first time; then drop its pieces' state and point them at the placeholder."""
        group = self.sub_groups[sub]
        mine = [pieces[index] for index in group.pieces]
        states = [optimizer_of[id(piece)].state.pop(piece, {}) for piece in mine]
        if _keys(states) != {(entry.piece, entry.key) for entry in group.layout} | set(group.scalars):
            # state appeared (the first step, or a piece stepped for the first time): the record grows; its
            # tensors may be views of this buffer at their old places, so they are copied out first
            states = [{key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
                      for state in states]
            values_bytes = 4 * group.numel
            _learn_layout(group, states)
            group.buffer = self.pool.grow(group.buffer, group.buffer_bytes, values_bytes)
        for entry in group.layout:
            state_tensor, target = states[entry.piece][entry.key], group.state_view(group.buffer, entry)
            if target.data_ptr() != state_tensor.data_ptr():
                target.copy_(state_tensor)
        for index, key in group.scalars:
            group.scalars[(index, key)] = states[index][key]
        buffer, group.buffer = group.buffer, None
        for piece in mine:
            piece.data = self.master[:piece.numel()].view(piece.shape)
            piece.grad = None
        record = buffer[:group.record_bytes]
        self.stats.record(Transfer.NVME_WRITE, record)

        def write_and_return() -> None:
            self.swap.write_record(group.file, record)
            self.pool.give(buffer)
        self.pool.waiting.append(self.swap.submit(write_and_return))

    def resident_values(self) -> torch.Tensor:
        """A copy of the master's values, every sub-group being paged in (ShardMasters.resident)."""
        return torch.cat([group.values(group.buffer) for group in self.sub_groups]) if self.numel else torch.zeros(0)

    # --- the compute shard (the gradient stays on the device: HeldGradient) ----------------------------
    def publish_paged(self, sub: int) -> None:
        """Sub-group `sub`'s updated values -> its part of the compute shard, while paged in (publish() itself
        has nothing left to do)."""
        group = self.sub_groups[sub]
        self.io.write(self.compute[group.begin:group.end], group.values(group.buffer), "host")

    def publish(self) -> None:
        pass

    def write_back(self) -> None:
        """The user edited the compute shard: read each record, keep the edits, write it back."""
        edited = self.io.read(self.compute, "host")
        for group in self.sub_groups:
            buffer = self.pool.take(group.record_bytes)
            self._read(group, buffer)
            copy_edits(group.values(buffer), edited[group.begin:group.end])
            self._write(group, buffer)
            self.pool.give(buffer)

    def held(self) -> dict[str, int]:
        """The records are on NVMe; the pool's buffers are counted once, by the masters (See ShardMasters)."""
        return {"optimizer_state": 0}

    def nvme_bytes(self) -> int:
        return sum(group.record_bytes for group in self.sub_groups)


def _keys(states: list[dict[str, Any]]) -> set[tuple[int, str]]:
    return {(index, key) for index, state in enumerate(states) for key in state}


def _learn_layout(group: SubGroup, states: list[dict[str, Any]]) -> None:
    group.layout, group.scalars = [], {}
    offset = round_up(4 * group.numel, TENSOR_ALIGN)
    for index, state in enumerate(states):
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                entry = StateEntry(index, key, value.dtype, tuple(value.shape), offset)
                group.layout.append(entry)
                offset = round_up(offset + _nbytes(entry), TENSOR_ALIGN)
            else:
                group.scalars[(index, key)] = value
    group.record_bytes = round_up(offset)


def _nbytes(entry: StateEntry) -> int:
    numel = 1
    for size in entry.shape:
        numel *= size
    return numel * entry.dtype.itemsize
