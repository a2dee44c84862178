"""offload_param.device=nvme (ZeRO-Infinity): stage 3's parameter shards in swap files, read through a bounded
pool of buffers for each gather; the first `max_in_cpu` elements of them stay in host memory instead, as
DeepSpeed keeps them.

[Note: parameter shards on NVMe]
The shard buffer a ShardedFlat holds is then a meta tensor: it has the right size, and a shard is a view of
it whose storage offset says which bucket it is, but no memory. DeepSpeed's max_in_cpu is a host cache, not
a bound: its stage 3 keeps the 16-bit partitions of the first max_in_cpu parameter elements in host memory
for good (stage3.py, _create_param_groups_fp16_flat_cpu_memory) and swaps only the rest. So here too bucket
shards go to the cache in order, trainable first, each one that still fits. Every other shard is cut into
chunks of at most `buffer_size` elements, each one record of the file at an aligned offset (See [Note: direct
I/O from Python] in swap.py), so that what they take in host memory is a pool of `buffer_count` buffers of one
chunk each, the buffer_count x buffer_size elements DeepSpeed's swapper pins (See [Note: a bounded pool of
swap buffers] there). A gather reads each chunk into a pool buffer and copies it into its place in the buffer
being gathered; writes (published masters, kept edits) go out asynchronously, and a read of a chunk waits for
the write of it still in flight. A write of part of a chunk (masters on NVMe publish a sub-group at a time,
in order) fills a pool buffer until the chunk is whole and writes it then; a part that does not continue it,
or a read of the chunk, first completes the buffer from the file. Units are gathered in about the same order
every step, so each read also starts reading, on the I/O threads, the chunk that was read after it the time
before: the next swap is prefetched while the unit computes. One such read at a time: a guess the gathers did
not take (backward runs the units in the other order) is dropped when the next starts, or each would hold a
pool buffer until its chunk is next read or written, and together the whole pool.
"""

from __future__ import annotations

import bisect
import sys
from concurrent.futures import Future
from contextlib import nullcontext
from typing import ContextManager, NamedTuple

import torch

from zerokit._support.log import logger
from zerokit.comm import CommStats, Transfer
from zerokit.config.typed import Offload
from zerokit.flat.layout import RankShards
from zerokit.tiers.pinned import host_buffer
from zerokit.tiers.preflight import check_host_memory, check_nvme
from zerokit.tiers.read_order import ReadOrder
from zerokit.tiers.swap import BufferPool, SwapDirectory, round_up

ChunkKey = tuple[str, int]  # (file, byte offset)
WRITES_IN_FLIGHT = 2  # one write queued behind another keeps a drive busy; more would only hold pool buffers


class Chunk(NamedTuple):
    key: ChunkKey
    begin: int  # elements from its shard's start
    numel: int


class Filling(NamedTuple):
    """A chunk written part by part: its pool buffer holds the chunk's first `filled` elements."""

    buffer: torch.Tensor
    filled: int


class _Allocation:
    """One ShardedFlat's shards (the trainable ones, or the frozen ones): where each bucket's shard lives."""

    def __init__(self, name: str, local: RankShards, dtype: torch.dtype, budget: int, chunk_numel: int,
                 pin: bool) -> None:
        self.name, self.dtype = name, dtype
        self.element = torch.empty((), dtype=dtype).element_size()
        self.begins = [begin for begin, end in local.ranges if end > begin]  # sorted: shards lie back to back
        self.numels = {begin: end - begin for begin, end in local.ranges if end > begin}
        self.cached: dict[int, int] = {}  # shard begin -> its offset in the cache
        self.chunks: dict[int, list[Chunk]] = {}  # shard begin -> its chunks on NVMe
        cached, offset = 0, 0
        for begin, numel in self.numels.items():
            if cached + numel <= budget:
                self.cached[begin] = cached
                cached += numel
                continue
            self.chunks[begin] = []
            for start in range(0, numel, chunk_numel):
                size = min(chunk_numel, numel - start)
                self.chunks[begin].append(Chunk((name, offset), start, size))
                offset += round_up(size * self.element)
        self.cache = host_buffer(cached, dtype=dtype, pin=pin, zeroed=True)  # See zerokit/tiers/pinned.py
        self.file_bytes = offset

    def locate(self, shard: torch.Tensor) -> tuple[int, int, int]:
        """(its bucket shard's begin, [lo, hi) within that shard) of a view of the shard buffer."""
        offset = shard.storage_offset()
        begin = self.begins[bisect.bisect_right(self.begins, offset) - 1]
        lo = offset - begin
        if lo + shard.numel() > self.numels[begin]:
            raise RuntimeError(f"a view of {shard.numel()} elements at {offset} crosses a bucket's shard "
                               "(an internal bug)")
        return begin, lo, lo + shard.numel()

    def record_bytes(self, chunk: Chunk) -> int:
        return round_up(chunk.numel * self.element)


class NvmeShards:
    """See [Note: parameter shards on NVMe]."""

    tier = "nvme"

    def __init__(self, device: torch.device, offload: Offload, stats: CommStats, swap: SwapDirectory,
                 ranks_per_node: int) -> None:
        self.device, self.stats, self.swap = device, stats, swap
        self.ranks_per_node = ranks_per_node  # whose files and buffers share this node's disk and host memory
        self.pin = offload.pin_memory and torch.cuda.is_available()
        self.budget = offload.max_in_cpu  # host-memory elements, over every allocation
        self.chunk_numel = offload.buffer_size or sys.maxsize  # 0: a shard is one record
        self.pool = BufferPool(offload.buffer_count, self.pin)
        self.allocations: dict[int, _Allocation] = {}  # id of the meta shard buffer -> its allocation
        self.chunk_of: dict[ChunkKey, tuple[_Allocation, Chunk]] = {}
        self.writes: dict[ChunkKey, Future] = {}
        self.reads: dict[ChunkKey, tuple[Future, torch.Tensor]] = {}
        self.filling: dict[ChunkKey, Filling] = {}
        self.order: ReadOrder[ChunkKey] = ReadOrder()

    def allocate(self, local: RankShards, dtype: torch.dtype) -> torch.Tensor:
        key = "zero_optimization.offload_param"
        element = torch.empty((), dtype=dtype).element_size()
        cached = min(self.budget, local.numel)
        largest = min(self.chunk_numel, max((end - begin for begin, end in local.ranges), default=0))
        check_host_memory(key, (cached + self.pool.count * largest) * element, self.ranks_per_node)
        records = len(local.ranges) + local.numel // self.chunk_numel  # each rounded up to a block at most
        check_nvme(key, str(self.swap.root.parent), round_up((local.numel - cached) * element) + records * 4096,
                   self.ranks_per_node)
        allocation = _Allocation(f"shards{len(self.allocations)}", local, dtype, self.budget, self.chunk_numel,
                                 self.pin)
        self.budget -= allocation.cache.numel()
        if allocation.cache.numel() and self.swap.rank == 0:
            logger.info("%s.max_in_cpu: %s of %s shard elements stay in host memory, not on NVMe (DeepSpeed's meaning; "
                        "its default, 1e9, keeps every shard of a smaller model there); 0 keeps only %d swap buffers",
                        key, f"{allocation.cache.numel():,}", f"{local.numel:,}", self.pool.count)
        for chunks in allocation.chunks.values():
            self.chunk_of.update((chunk.key, (allocation, chunk)) for chunk in chunks)
        shards = torch.empty(local.numel, dtype=dtype, device="meta")
        self.allocations[id(shards)] = allocation
        return shards

    def _allocation(self, shard: torch.Tensor) -> _Allocation:
        return self.allocations[id(shard._base if shard._base is not None else shard)]

    # --- reading ------------------------------------------------------------------------------------
    def issuing(self) -> ContextManager[None]:
        """The default stream: a fetch reads files on this thread first, which no stream overlaps."""
        return nullcontext()

    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        if shard.numel():
            self._copy_out(shard, slot)
            self.stats.record(Transfer.HOST_TO_DEVICE, slot)
        return slot

    def read(self, shard: torch.Tensor, target: str) -> torch.Tensor:
        values = torch.empty(shard.numel(), dtype=shard.dtype)
        self._copy_out(shard, values)
        if target == "device":
            self.stats.record(Transfer.HOST_TO_DEVICE, values)
            return values.to(self.device)
        return values

    def _copy_out(self, shard: torch.Tensor, into: torch.Tensor) -> None:
        """The values of `shard` (a view of the shard buffer within one bucket's shard) into `into`."""
        if not shard.numel():
            return
        allocation = self._allocation(shard)
        begin, lo, hi = allocation.locate(shard)
        if begin in allocation.cached:
            start = allocation.cached[begin] + lo
            into.copy_(allocation.cache[start:start + hi - lo])
            return
        for chunk in allocation.chunks[begin]:
            a, b = max(lo, chunk.begin), min(hi, chunk.begin + chunk.numel)
            if a < b:
                buffer = self._chunk_values(allocation, chunk)
                values = buffer[:chunk.numel * allocation.element].view(allocation.dtype)
                into[a - lo:b - lo].copy_(values[a - chunk.begin:b - chunk.begin])  # synchronous: the buffer goes back
                self.pool.give(buffer)

    def _chunk_values(self, allocation: _Allocation, chunk: Chunk) -> torch.Tensor:
        """A pool buffer holding the chunk (the caller gives it back): read ahead, or read now."""
        filling = self.filling.pop(chunk.key, None)
        if filling is not None:
            self._complete(allocation, chunk, filling)
        future, buffer = self.reads.pop(chunk.key, None) or self._start_read(allocation, chunk)
        future.result()
        self._read_ahead(chunk.key)
        return buffer

    def _start_read(self, allocation: _Allocation, chunk: Chunk) -> tuple[Future, torch.Tensor]:
        if chunk.key in self.writes:
            self.writes.pop(chunk.key).result()  # the chunk is still being written
        nbytes = allocation.record_bytes(chunk)
        buffer = self.pool.take(nbytes)
        record = buffer[:nbytes]
        self.stats.record(Transfer.NVME_READ, record)
        return self.swap.submit(self.swap.file(allocation.name).read, chunk.key[1], record), buffer

    def _read_ahead(self, key: ChunkKey) -> None:
        """Start reading the chunk that followed this one last time, dropping a read ahead that the gathers did not
        take: one at a time (See [Note: parameter shards on NVMe])."""
        following = self.order.read(key)
        if following is None:
            return
        for stale in [pending for pending in self.reads if pending != following]:
            self._drop_read(stale)
        if following not in self.reads and self.pool.can_lend():
            self.reads[following] = self._start_read(*self.chunk_of[following])

    # --- writing ------------------------------------------------------------------------------------
    def write(self, shard: torch.Tensor, values: torch.Tensor, source: str) -> None:
        """`values` into `shard` (a view of the shard buffer within one bucket's shard)."""
        allocation = self._allocation(shard)
        if source == "device":
            self.stats.record(Transfer.DEVICE_TO_HOST, values)
        if not shard.numel():
            return
        begin, lo, hi = allocation.locate(shard)
        if begin in allocation.cached:
            start = allocation.cached[begin] + lo
            allocation.cache[start:start + hi - lo].copy_(values)
            return
        for chunk in allocation.chunks[begin]:
            a, b = max(lo, chunk.begin), min(hi, chunk.begin + chunk.numel)
            if a < b:
                self._write_part(allocation, chunk, a - chunk.begin, values[a - lo:b - lo])

    def _write_part(self, allocation: _Allocation, chunk: Chunk, start: int, part: torch.Tensor) -> None:
        """`part` into the chunk from element `start`: whole, written now; else filled into a buffer."""
        filling = self.filling.pop(chunk.key, None)
        if filling is not None and filling.filled != start:  # not its continuation: finish the one before
            self._complete(allocation, chunk, filling)
            filling = None
        if filling is None:
            self._drop_read(chunk.key)  # a read-ahead of the old values
            self.pool.throttle(WRITES_IN_FLIGHT)
            if start == 0:
                filling = Filling(self.pool.take(allocation.record_bytes(chunk)), 0)
            else:  # a part that does not begin the chunk: start from the chunk as it is
                future, buffer = self._start_read(allocation, chunk)
                future.result()
                filling = Filling(buffer, chunk.numel)
        values = filling.buffer[:chunk.numel * allocation.element].view(allocation.dtype)
        values[start:start + part.numel()].copy_(part)
        filled = max(filling.filled, start + part.numel())
        if filled == chunk.numel:
            self._write_out(allocation, chunk, filling.buffer)
        else:
            self.filling[chunk.key] = Filling(filling.buffer, filled)

    def _complete(self, allocation: _Allocation, chunk: Chunk, filling: Filling) -> None:
        """The rest of a chunk being filled, from the file; then it is written."""
        future, whole = self._start_read(allocation, chunk)
        future.result()
        element = allocation.element
        filling.buffer[filling.filled * element:chunk.numel * element].copy_(
            whole[filling.filled * element:chunk.numel * element])
        self.pool.give(whole)
        self._write_out(allocation, chunk, filling.buffer)

    def _write_out(self, allocation: _Allocation, chunk: Chunk, buffer: torch.Tensor) -> None:
        """Write the chunk from `buffer` (asynchronously; the buffer goes back to the pool when done)."""
        if chunk.key in self.writes:
            self.writes.pop(chunk.key).result()
        record = buffer[:allocation.record_bytes(chunk)]
        self.stats.record(Transfer.NVME_WRITE, record)

        def write_and_return() -> None:
            self.swap.file(allocation.name).write(chunk.key[1], record)
            self.pool.give(buffer)
        self.writes[chunk.key] = self.swap.submit(write_and_return)
        self.pool.waiting.append(self.writes[chunk.key])

    def _drop_read(self, key: ChunkKey) -> None:
        stale = self.reads.pop(key, None)
        if stale is not None:
            stale[0].result()
            self.pool.give(stale[1])

    def held(self, shards: torch.Tensor) -> dict[str, int]:
        """The cache, and the pool of swap buffers (counted with the first allocation: they share it), in host
        memory; the chunks on NVMe."""
        allocation = self.allocations[id(shards)]
        pool = self.pool.held_bytes() if allocation is next(iter(self.allocations.values())) else 0
        return {"host": allocation.cache.numel() * allocation.element + pool, "nvme": allocation.file_bytes}
