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
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN = 4096
SWAP_FOLDER = "zerokit-swap"


def round_up(value: int, multiple: int = ALIGN) -> int:
    return -(-value // multiple) * multiple


def aligned_bytes(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """A 1-D uint8 tensor of round_up(nbytes) bytes whose address is a multiple of ALIGN."""
    size = round_up(max(nbytes, 1))
    pin = pin_memory and torch.cuda.is_available()
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
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
    """At most `count` aligned host buffers, handed out and returned; a buffer grows when a record needs it."""

    def __init__(self, count: int, pin_memory: bool) -> None:
        self.count, self.pin = max(count, 2), pin_memory
        self.free: list[torch.Tensor] = []
        self.made = 0
        self.waiting: list[Future] = []  # writes whose buffers come back when they finish

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes`: a free one, else a new one while fewer than `count` exist, else the
        one the oldest write in flight gives back when it finishes."""
        while not self.free and self.made >= self.count and self.waiting:
            self.waiting.pop(0).result()
        if not self.free:
            self.made += 1
            return aligned_bytes(nbytes, self.pin)
        buffer = self.free.pop()
        return buffer if buffer.numel() >= nbytes else aligned_bytes(nbytes, self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)

    def held_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self.free)

    def drain(self) -> None:
        while self.waiting:
            self.waiting.pop(0).result()


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
