"""Before training: can each tier hold its share? A tier that cannot gets a one-line error naming the key, what
it needs and what there is, at initialize, not an out-of-memory error an hour later.

Host memory is shared by the ranks of a node (the settings' ranks per node: the config's, else torchrun's
LOCAL_WORLD_SIZE, else every rank), so a rank checks that all of them fit in what the node has available
(MemAvailable). An NVMe path must be a writable directory on a file
system with room for every local rank's files; a short write and read (direct I/O where allowed) proves it
and measures it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from zerokit.tiers.swap import ALIGN, SwapFile, aligned_bytes

GIB = 2**30
PROBE_BYTES = 4 * 2**20
# Optimizer state bytes per element, for the check only (the engine counts the real bytes): Adam-like
# optimizers keep two fp32 moments; an optimizer not listed is assumed to keep as much.
STATE_BYTES = {"SGD": 4, "Adagrad": 4, "RMSprop": 8, "Muon": 4, "Adafactor": 4}
DEFAULT_STATE_BYTES = 8


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or what os reports."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_disk_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_host_memory(key: str, needed: int, ranks: int) -> None:
    """`needed`: bytes this rank will hold in host memory for the tier named by `key`; `ranks`: the ranks of its node,
    each holding as much."""
    available = available_host_bytes()
    if needed * ranks > available:
        raise ValueError(f"{key} needs {needed * ranks / GIB:.2f} GiB of host memory on this node ({ranks} rank(s) x "
                         f"{needed / GIB:.2f} GiB) but {available / GIB:.2f} GiB are available; offload to nvme, use "
                         "more nodes, or free host memory")


def check_nvme(key: str, nvme_path: str, needed: int, ranks: int) -> float:
    """`needed`: bytes of files this rank will write under `nvme_path`, as each of the `ranks` of its node will.
    Returns the probe's write+read GB/s."""
    path = Path(nvme_path)
    if not path.exists():
        raise ValueError(f"{key}.nvme_path={nvme_path!r} does not exist; give an existing directory on the NVMe drive")
    if not path.is_dir():
        raise ValueError(f"{key}.nvme_path={nvme_path!r} is not a directory")
    seconds = _probe(key, path)
    free = free_disk_bytes(path)
    if needed * ranks > free:
        raise ValueError(f"{key}.nvme_path={nvme_path!r} needs {needed * ranks / GIB:.2f} GiB free for {ranks} rank(s) "
                         f"but has {free / GIB:.2f} GiB; free space there or give another path")
    return 2 * PROBE_BYTES / seconds / 1e9


def _probe(key: str, path: Path) -> float:
    """Write and read PROBE_BYTES back; returns the seconds it took, or raises naming the key."""
    probe = path / f".zerokit-probe-{os.getpid()}"
    data = aligned_bytes(PROBE_BYTES)
    data.random_(0, 255)
    back = aligned_bytes(PROBE_BYTES)
    started = time.perf_counter()
    try:
        swap = SwapFile(probe)
        try:
            swap.write(0, data)
            swap.read(0, back)
        finally:
            swap.close()
    except OSError as error:
        raise ValueError(f"{key}.nvme_path={str(path)!r} is not writable: {error.strerror or error}") from None
    finally:
        probe.unlink(missing_ok=True)
    if not bool((data == back).all()):
        raise ValueError(f"{key}.nvme_path={str(path)!r} returned other bytes than were written to it")
    return max(time.perf_counter() - started, 1e-9)


def state_bytes_per_element(optimizer_names: list[str]) -> int:
    return max((STATE_BYTES.get(name, DEFAULT_STATE_BYTES) for name in optimizer_names), default=DEFAULT_STATE_BYTES)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
