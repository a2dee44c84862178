"""The NVMe tier (offload_optimizer.device=nvme, ZeRO-Infinity): a master and its optimizer state live in a
swap file and come into host memory only for their own optimizer step.

[Note: paging a master through a bounded pool]
Each master (one bucket's shard) is one record in its file: the fp32 values, then every optimizer-state
tensor of its pieces (in piece order, keys sorted), each at a 64-byte boundary, the whole padded to
4096 bytes for direct I/O. The record's layout is learned the first time the master is written back
after a step (optimizer state is created at the first step). At the step, masters are paged in one at a
time into buffers from a pool of `buffer_count`: while one is stepped the next is read and the one
before is written (ShardMasters.step), so host memory holds at most buffer_count records, whatever the
model's size. Paged in, the pieces' data and the optimizer's state entries are views of the buffer;
paged out, the pieces point at a zero-stride placeholder and the state entries are gone, so nothing
but the pool holds host memory. A buffer also has room for the master's fp32 gradient, copied in from
the device's reduced (already unscaled and clipped) gradient shard just before the step; publishing the
updated values to the compute shard happens right after it, while the record is in memory.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, NamedTuple

import torch
from torch import nn

from zerokit.comm import CommStats, Transfer
from zerokit.masters.homes import HeldGradient, ShardIO, copy_edits
from zerokit.offload.swap import BufferPool, SwapDirectory, aligned_bytes, round_up

TENSOR_ALIGN = 64  # bytes: every state tensor starts at such a boundary (any dtype's alignment)


class StateEntry(NamedTuple):
    piece: int
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the record's start


class NvmeHome(HeldGradient):
    """See [Note: paging a master through a bounded pool]."""

    tier = "nvme"
    paged = True

    def __init__(self, compute: torch.Tensor, name: str, swap: SwapDirectory, pool: BufferPool, stats: CommStats,
                 io: ShardIO) -> None:
        self.compute, self.swap, self.pool, self.stats, self.io = compute, swap, pool, stats, io
        self.numel = compute.numel()
        self.file = swap.file(name)
        self.master = torch.zeros(1).expand(self.numel)  # a placeholder the pieces are cut from; no memory
        self.layout: list[StateEntry] = []
        self.scalars: dict[tuple[int, str], Any] = {}  # state values that are not tensors
        self.record_bytes = round_up(4 * self.numel)
        self.buffer: torch.Tensor | None = None
        self.reading: Future | None = None

    # --- values on the way in and out ---------------------------------------------------------------
    def initialise(self, values: torch.Tensor) -> None:
        buffer = self.pool.take(self.record_bytes)
        self._values(buffer).copy_(values)
        self._write(buffer, self.record_bytes)
        self.pool.give(buffer)

    def _values(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:4 * self.numel].view(torch.float32)

    def _grad_area(self, buffer: torch.Tensor) -> torch.Tensor:
        start = self.record_bytes
        return buffer[start:start + 4 * self.numel].view(torch.float32)

    def _write(self, buffer: torch.Tensor, nbytes: int) -> None:
        self.file.write(0, buffer[:nbytes])
        self.stats.record(Transfer.NVME_WRITE, buffer[:nbytes])

    # --- paging ------------------------------------------------------------------------------------
    def start_reading(self) -> None:
        """Begin reading the record into a pool buffer (returns at once)."""
        self.buffer = self.pool.take(self.record_bytes + 4 * self.numel)
        record = self.buffer[:self.record_bytes]
        self.reading = self.swap.submit(self.file.read, 0, record)
        self.stats.record(Transfer.NVME_READ, record)

    def page_in(self, pieces: list[nn.Parameter], offsets: list[int], optimizer_of: dict[int, torch.optim.Optimizer],
                with_grad: bool) -> None:
        """Wait for the read, then point the pieces and their optimizer state at the buffer; with_grad: also
        copy this step's gradient in and attach it."""
        if self.reading is None:
            self.start_reading()
        self.reading.result()
        self.reading = None
        values = self._values(self.buffer)
        for piece, offset in zip(pieces, offsets):
            piece.data = values[offset:offset + piece.numel()].view(piece.shape)
        for entry in self.layout:
            tensor = self.buffer[entry.offset:entry.offset + _nbytes(entry)].view(entry.dtype).view(entry.shape)
            optimizer_of[id(pieces[entry.piece])].state[pieces[entry.piece]][entry.key] = tensor
        for (index, key), value in self.scalars.items():
            optimizer_of[id(pieces[index])].state[pieces[index]][key] = value
        if with_grad:
            grad = self._grad_area(self.buffer)
            grad.copy_(self.grad32())
            self.stats.record(Transfer.DEVICE_TO_HOST, grad)
            for piece, offset in zip(pieces, offsets):
                piece.grad = grad[offset:offset + piece.numel()].view(piece.shape)

    def page_out(self, pieces: list[nn.Parameter], optimizer_of: dict[int, torch.optim.Optimizer]) -> None:
        """Write the record back (asynchronously; the buffer returns to the pool when done), learning its
        layout the first time; then drop the pieces' state and point them at the placeholder."""
        states = [optimizer_of[id(piece)].state.pop(piece, {}) for piece in pieces]
        if self._keys(states) != {(entry.piece, entry.key) for entry in self.layout} | set(self.scalars):
            # state appeared (the first step, or a piece stepped for the first time): the record grows; its
            # tensors may be views of this buffer at their old places, so they are copied out first
            states = [{key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
                      for state in states]
            self._learn_layout(states)
            self.buffer = self._grown(self.buffer)
        for entry in self.layout:
            state_tensor = states[entry.piece][entry.key]
            target = self.buffer[entry.offset:entry.offset + _nbytes(entry)].view(entry.dtype).view(entry.shape)
            if target.data_ptr() != state_tensor.data_ptr():
                target.copy_(state_tensor)
        for index, key in self.scalars:
            self.scalars[(index, key)] = states[index][key]
        buffer, nbytes = self.buffer, self.record_bytes
        self.buffer = None
        for piece in pieces:
            piece.data = self.master[:piece.numel()].view(piece.shape)
            piece.grad = None
        self.stats.record(Transfer.NVME_WRITE, buffer[:nbytes])

        def write_and_return() -> None:
            self.file.write(0, buffer[:nbytes])
            self.pool.give(buffer)
        self.pool.waiting.append(self.swap.submit(write_and_return))

    @staticmethod
    def _keys(states: list[dict[str, Any]]) -> set[tuple[int, str]]:
        return {(index, key) for index, state in enumerate(states) for key in state}

    def _learn_layout(self, states: list[dict[str, Any]]) -> None:
        self.layout, self.scalars = [], {}
        offset = round_up(4 * self.numel, TENSOR_ALIGN)
        for index, state in enumerate(states):
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    entry = StateEntry(index, key, value.dtype, tuple(value.shape), offset)
                    self.layout.append(entry)
                    offset = round_up(offset + _nbytes(entry), TENSOR_ALIGN)
                else:
                    self.scalars[(index, key)] = value
        self.record_bytes = round_up(offset)

    def _grown(self, buffer: torch.Tensor) -> torch.Tensor:
        """A buffer big enough for the record now that its state is known, holding the master values."""
        if buffer.numel() >= self.record_bytes + 4 * self.numel:
            return buffer
        grown = aligned_bytes(self.record_bytes + 4 * self.numel, self.pool.pin)
        grown[:4 * self.numel].copy_(buffer[:4 * self.numel])
        return grown

    # --- the compute shard (the gradient stays on the device: HeldGradient) ----------------------------
    def publish_paged(self) -> None:
        """Updated values -> the compute shard, while paged in (publish() itself has nothing left to do)."""
        self.io.write(self.compute, self._values(self.buffer), "host")

    def publish(self) -> None:
        pass

    def write_back(self) -> None:
        """The user edited the compute shard: read the record, keep the edits, write it back."""
        buffer = self.pool.take(self.record_bytes)
        self.file.read(0, buffer[:self.record_bytes])
        copy_edits(self._values(buffer), self.io.read(self.compute, "host"))
        self._write(buffer, self.record_bytes)
        self.pool.give(buffer)

    def held(self) -> dict[str, int]:
        """The record on NVMe; the pool's buffers are counted once, by the masters (See ShardMasters)."""
        return {"optimizer_state": 0}

    def nvme_bytes(self) -> int:
        return self.record_bytes


def _nbytes(entry: StateEntry) -> int:
    numel = 1
    for size in entry.shape:
        numel *= size
    return numel * torch.empty((), dtype=entry.dtype).element_size()
