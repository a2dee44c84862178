"""NVMe swap files: aligned buffers, direct I/O where the file system allows it, reads and writes on a thread
pool, and a swap directory that cleans up after itself (and after a crashed run).

[Note: direct I/O from Python]
O_DIRECT bypasses the page cache, so a swapped-out optimizer state does not come back as cached pages
that fill the host memory NVMe offload is there to save. It needs every buffer address, file offset and
length to be a multiple of the block size (4096 covers every device here), so buffers are carved out of
a slightly larger allocation at an aligned address, and every record's offset and size are rounded up.
The calls are os.preadv/os.pwritev, which release the GIL: a few threads keep several requests in
flight while Python steps the optimizer. Where the file system refuses O_DIRECT (tmpfs, some network
file systems), files are opened buffered and that is said once in the start-up log.

[Note: a bounded pool of swap buffers]
Everything an NVMe tier reads or writes passes through its BufferPool, and the pool is all the host memory
the tier holds besides what it is told to keep there (offload_param.max_in_cpu): NVMe offload frees host
memory only if that pool stays small whatever the model's size. So a record is small (an optimizer
sub-group, a parameter chunk of at most offload_param.buffer_size elements), and the pool makes at most
`buffer_count` buffers, each reused for record after record; a record larger than every free buffer
replaces the largest of them. When all are lent and no write is in flight to give one back (a tier
holding several records at once, as a checkpoint of a whole master does), one more is made for that use
and dropped when given back, so the pool returns to its bound. `held_bytes` counts every buffer made, lent
or free: what memory_by_tier() reports in host memory for the tier. Unpinned buffers are pages mapped for
each alone, not malloc's: a buffer made in the middle of training would otherwise sit on top of malloc's
heap, and every activation freed below it would stay resident (glibc returns heap memory to the system only
from the top); a 16.8M-parameter stage-3 run's peak RSS grew by 85 MiB that way, and varied by as much from
run to run.
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import shutil
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zerokit.tiers.pinned import host_buffer

ALIGN = 4096
SWAP_FOLDER = "zerokit-swap"


def round_up(value: int, multiple: int = ALIGN) -> int:
    return -(-value // multiple) * multiple


def aligned_bytes(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """A 1-D uint8 tensor of round_up(nbytes) bytes whose address is a multiple of ALIGN: pinned (page-locked
    by zerokit/tiers/pinned.py), or pages mapped for it alone (See [Note: a bounded pool of swap buffers])."""
    size = round_up(max(nbytes, 1))
    if not (pin_memory and torch.cuda.is_available()):
        return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # page-aligned; unmapped when freed
    raw = host_buffer(size + ALIGN, dtype=torch.uint8, pin=True)  # See [Note: pinned memory of the size asked for]
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + size]


class SwapFile:
    """One file read and written in aligned blocks (See [Note: direct I/O from Python])."""

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT
        try:
            self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self.fd, self.direct = os.open(path, flags, 0o600), False

    def write(self, offset: int, data: torch.Tensor) -> None:
        """`data`: an aligned uint8 tensor (aligned_bytes), written whole at `offset` (a multiple of ALIGN)."""
        view = memoryview(data.numpy())
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def read(self, offset: int, into: torch.Tensor) -> None:
        view = memoryview(into.numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"swap file {self.path} ended {len(view) - done} bytes early at offset {offset + done}")
            done += got

    def close(self) -> None:
        os.close(self.fd)


class BufferPool:
    """Up to `count` aligned host buffers, lent and given back: all the host memory an NVMe tier pages through
    (See [Note: a bounded pool of swap buffers])."""

    def __init__(self, count: int, pin_memory: bool) -> None:
        self.count, self.pin = max(count, 2), pin_memory
        self.free: list[torch.Tensor] = []
        self.lent = 0
        self.held = 0  # bytes of every buffer made and not dropped, free or lent
        self.waiting: list[Future] = []  # writes whose buffers come back when they finish
        self._lock = threading.Lock()  # writes give their buffers back on the I/O threads

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes`: the smallest free one that is large enough, else a new one while fewer
        than `count` exist (a free one too small is dropped for it), else the one the oldest write in flight
        gives back. With every buffer lent and no write in flight, one more, dropped when it is given back."""
        while not self.free and self.lent >= self.count and self.waiting:
            self.waiting.pop(0).result()
        with self._lock:
            fitting = [buffer for buffer in self.free if buffer.numel() >= nbytes]
            if fitting:
                buffer = min(fitting, key=torch.Tensor.numel)
                self._remove(buffer)
            else:
                if self.free and self.lent + len(self.free) >= self.count:
                    self._drop(max(self.free, key=torch.Tensor.numel))
                buffer = aligned_bytes(nbytes, self.pin)
                self.held += _allocated(buffer)
            self.lent += 1
            return buffer

    def grow(self, buffer: torch.Tensor, nbytes: int, keep: int) -> torch.Tensor:
        """A lent `buffer` that must hold `nbytes` now, its first `keep` bytes kept: itself if it can, else a
        larger one in its place."""
        if buffer.numel() >= nbytes:
            return buffer
        larger = aligned_bytes(nbytes, self.pin)
        larger[:keep].copy_(buffer[:keep])
        with self._lock:
            self.held += _allocated(larger) - _allocated(buffer)
        return larger

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.lent -= 1
            self.free.append(buffer)
            if self.lent + len(self.free) > self.count:  # one made beyond the count: not kept
                self._drop(buffer)

    def can_lend(self) -> bool:
        """Whether `take` would lend a buffer without making one beyond the count (waiting for a write, maybe)."""
        return bool(self.free) or self.lent < self.count or bool(self.waiting)

    def throttle(self, in_flight: int) -> None:
        """Wait until fewer than `in_flight` writes are in flight: a burst of writes (every shard written at
        start-up) would otherwise have the pool make all its buffers, and keep them."""
        while self.waiting and (self.waiting[0].done() or len(self.waiting) >= in_flight):
            self.waiting.pop(0).result()

    def held_bytes(self) -> int:
        return self.held

    def drain(self) -> None:
        while self.waiting:
            self.waiting.pop(0).result()

    def _drop(self, buffer: torch.Tensor) -> None:
        self._remove(buffer)
        self.held -= _allocated(buffer)

    def _remove(self, buffer: torch.Tensor) -> None:
        """Out of the free list, by identity (`list.remove` would compare tensors element by element)."""
        del self.free[next(i for i, free in enumerate(self.free) if free is buffer)]


def _allocated(buffer: torch.Tensor) -> int:
    """The bytes of the allocation an aligned buffer was carved from."""
    return buffer.untyped_storage().nbytes()


class SwapDirectory:
    """This process's swap files, under <nvme_path>/zerokit-swap/<host>-<pid>-rank<r>-<kind>. Removed at exit;
    folders left by processes of this host that are no longer alive (a crashed run) are removed at start."""

    def __init__(self, nvme_path: str, rank: int, kind: str, threads: int = 4) -> None:
        self.root = Path(nvme_path) / SWAP_FOLDER
        self.root.mkdir(exist_ok=True)  # nvme_path itself must exist (See preflight.check_nvme)
        remove_leftovers(self.root)
        self.rank = rank
        self.path = self.root / f"{socket.gethostname()}-{os.getpid()}-rank{rank}-{kind}"
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir()
        self.files: dict[str, SwapFile] = {}
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"zerokit-{kind}-io")
        atexit.register(self.close)

    def file(self, name: str) -> SwapFile:
        if name not in self.files:
            self.files[name] = SwapFile(self.path / name)
        return self.files[name]

    def write_record(self, name: str, data: torch.Tensor) -> None:
        """`data` (aligned_bytes) as the whole of file `name`, opened for this write only: a tier with a record
        per file can have more files than a process may keep open."""
        swap = SwapFile(self.path / name)
        try:
            swap.write(0, data)
        finally:
            swap.close()

    def read_record(self, name: str, into: torch.Tensor) -> None:
        """File `name`'s first `into.numel()` bytes into `into`, the file opened for this read only."""
        swap = SwapFile(self.path / name)
        try:
            swap.read(0, into)
        finally:
            swap.close()

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    @property
    def direct_io(self) -> bool:
        """Whether this file system takes direct I/O (tried on a file of the folder)."""
        return self.file(".direct").direct

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for swap in self.files.values():
            swap.close()
        self.files.clear()
        shutil.rmtree(self.path, ignore_errors=True)


def remove_leftovers(root: Path) -> list[Path]:
    """Remove swap folders of this host whose process is gone; returns what was removed."""
    host = socket.gethostname()
    removed = []
    for folder in root.iterdir() if root.is_dir() else []:
        pid = _pid_of(folder.name, host)
        if pid is not None and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _pid_of(name: str, host: str) -> int | None:
    prefix = f"{host}-"
    if not name.startswith(prefix):
        return None
    pid = name[len(prefix):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
