"""offload_param.device=nvme (ZeRO-Infinity): stage 3's parameter shards in a swap file; the first
`max_in_cpu` elements of them stay in host memory, as DeepSpeed keeps them.

[Note: parameter shards on NVMe]
The shard buffer a ShardedFlat holds is then a meta tensor: it has the right size, and a shard is a view of
it whose storage offset says which bucket it is, but no memory. Each bucket's shard that does not fit the
host cache is one record of the file, at an aligned offset (See [Note: direct I/O from Python] in swap.py).
A gather reads the record into a pool buffer and copies it into its slot of the buffer being gathered;
writes (published masters, kept edits) go out asynchronously, and a read of a record waits for the write
of it still in flight. Units are gathered in about the same order every step, so each read also starts
reading, on the I/O threads, the record that was read after it the step before: the next swap is
prefetched while the unit computes.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from zerokit.comm import CommStats, Transfer
from zerokit.config import Offload
from zerokit.flat.layout import RankShards
from zerokit.offload.preflight import check_host_memory, check_nvme
from zerokit.offload.swap import BufferPool, SwapDirectory, round_up


class _Allocation:
    """One ShardedFlat's shards (the trainable ones, or the frozen ones): where each bucket's shard lives."""

    def __init__(self, name: str, local: RankShards, dtype: torch.dtype, budget: int, pin: bool) -> None:
        self.name, self.dtype = name, dtype
        self.element = torch.empty((), dtype=dtype).element_size()
        self.place: dict[int, tuple[str, int, int]] = {}  # shard begin -> ("cpu"|"file", offset, numel)
        cached, offset = 0, 0
        for begin, end in local.ranges:
            if end == begin:
                continue
            if cached + end - begin <= budget:
                self.place[begin] = ("cpu", cached, end - begin)
                cached += end - begin
            else:
                self.place[begin] = ("file", offset, end - begin)
                offset += round_up((end - begin) * self.element)
        self.cache = torch.zeros(cached, dtype=dtype, pin_memory=pin)
        self.file_bytes = offset


class NvmeShards:
    """See [Note: parameter shards on NVMe]."""

    tier = "nvme"

    def __init__(self, device: torch.device, offload: Offload, stats: CommStats, swap: SwapDirectory) -> None:
        self.device, self.stats, self.swap = device, stats, swap
        self.pin = offload.pin_memory and torch.cuda.is_available()
        self.budget = offload.max_in_cpu  # host-memory elements, over every allocation
        self.pool = BufferPool(offload.buffer_count, self.pin)
        self.allocations: dict[int, _Allocation] = {}  # id of the meta shard buffer -> its allocation
        self.writes: dict[tuple[str, int], Future] = {}
        self.reads: dict[tuple[str, int], tuple[Future, torch.Tensor]] = {}
        self.order: dict[tuple[str, int], tuple[str, int]] = {}  # record -> the record read after it last time
        self.last_read: tuple[str, int] | None = None

    def allocate(self, local: RankShards, dtype: torch.dtype) -> torch.Tensor:
        key = "zero_optimization.offload_param"
        element = torch.empty((), dtype=dtype).element_size()
        cached = min(self.budget, local.numel)
        check_host_memory(key, (cached + self.pool.count * max((e - b for b, e in local.ranges), default=0)) * element)
        check_nvme(key, str(self.swap.root.parent), round_up((local.numel - cached) * element) + len(local.ranges) * 4096)
        allocation = _Allocation(f"shards{len(self.allocations)}", local, dtype, self.budget, self.pin)
        self.budget -= allocation.cache.numel()
        shards = torch.empty(local.numel, dtype=dtype, device="meta")
        self.allocations[id(shards)] = allocation
        return shards

    def _locate(self, shard: torch.Tensor) -> tuple[_Allocation, str, int, int]:
        allocation = self.allocations[id(shard._base if shard._base is not None else shard)]
        where, offset, numel = allocation.place[shard.storage_offset()]
        return allocation, where, offset, numel

    # --- reading ------------------------------------------------------------------------------------
    def fetch(self, shard: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        if shard.numel():
            slot.copy_(self._host_values(shard))  # synchronous: the pool buffer is reused right after
            self.stats.record(Transfer.HOST_TO_DEVICE, slot)
        return slot

    def read(self, shard: torch.Tensor, target: str) -> torch.Tensor:
        values = self._host_values(shard).clone()
        if target == "device":
            self.stats.record(Transfer.HOST_TO_DEVICE, values)
            return values.to(self.device)
        return values

    def _host_values(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard's values in host memory: its cache slice, or its record read (or being read) into a pool
        buffer, which goes back to the pool once these values are used (the caller copies them)."""
        allocation, where, offset, numel = self._locate(shard)
        if where == "cpu":
            return allocation.cache[offset:offset + numel]
        key = (allocation.name, offset)
        future, buffer = self.reads.pop(key, None) or self._start_read(allocation, offset, numel)
        future.result()
        self._read_ahead(key)
        self.pool.give(buffer)  # safe: the caller copies the values out before anything takes the buffer again
        return buffer[:numel * allocation.element].view(allocation.dtype)

    def _start_read(self, allocation: _Allocation, offset: int, numel: int) -> tuple[Future, torch.Tensor]:
        key = (allocation.name, offset)
        if key in self.writes:
            self.writes.pop(key).result()  # the record is still being written
        buffer = self.pool.take(round_up(numel * allocation.element))
        record = buffer[:round_up(numel * allocation.element)]
        self.stats.record(Transfer.NVME_READ, record)
        return self.swap.submit(self.swap.file(allocation.name).read, offset, record), buffer

    def _read_ahead(self, key: tuple[str, int]) -> None:
        """Start reading the record that followed this one last time (See [Note: parameter shards on NVMe])."""
        if self.last_read is not None and self.last_read != key:
            self.order[self.last_read] = key
        self.last_read = key
        following = self.order.get(key)
        if following is not None and following not in self.reads and following != key:
            allocation = next(a for a in self.allocations.values() if a.name == following[0])
            place = next(p for p in allocation.place.values() if p[0] == "file" and p[1] == following[1])
            self.reads[following] = self._start_read(allocation, following[1], place[2])

    # --- writing ------------------------------------------------------------------------------------
    def write(self, shard: torch.Tensor, values: torch.Tensor, source: str) -> None:
        allocation, where, offset, numel = self._locate(shard)
        if source == "device":
            self.stats.record(Transfer.DEVICE_TO_HOST, values)
        if where == "cpu":
            allocation.cache[offset:offset + numel].copy_(values)
            return
        key = (allocation.name, offset)
        if key in self.writes:
            self.writes.pop(key).result()
        stale = self.reads.pop(key, None)  # a read-ahead of the old values
        if stale is not None:
            stale[0].result()
            self.pool.give(stale[1])
        buffer = self.pool.take(round_up(numel * allocation.element))
        buffer[:numel * allocation.element].view(allocation.dtype).copy_(values)
        record = buffer[:round_up(numel * allocation.element)]
        self.stats.record(Transfer.NVME_WRITE, record)

        def write_and_return() -> None:
            self.swap.file(allocation.name).write(offset, record)
            self.pool.give(buffer)
        self.writes[key] = self.swap.submit(write_and_return)
        self.pool.waiting.append(self.writes[key])

    def held(self, shards: torch.Tensor) -> dict[str, int]:
        allocation = self.allocations[id(shards)]
        return {"host": allocation.cache.numel() * allocation.element, "nvme": allocation.file_bytes}
