"""`zerokit plan --measure-device`: the numbers a plan needs about a machine the catalogue does not list,
timed on this machine (See zerokit/planner/device.py for what each one is and how it is used).

Each rank of a job is one process with `threads` threads, so everything is timed with that many
threads; the link is timed between `world` gloo ranks on this host (for a GPU, pass the catalogue's
numbers instead: this measures the CPU).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerokit.config.typed import DTYPES_BY_NAME
from zerokit.planner.device import DeviceProfile, optimizer_key
from zerokit.profiling.measure import resident_bytes
from zerokit.config.settings import optimizer_piece_numel

DTYPES = {name: DTYPES_BY_NAME[name] for name in ("fp32", "bf16")}  # the compute dtypes the catalogue rates


def _best_of(repeats: int, fn: Callable[[], None]) -> float:
    fn()  # warm-up: first calls pick kernels and fault pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_flops(dtype: torch.dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_of(3, lambda: torch.mm(a, b))


def copy_bandwidth(numel: int = 32 * 2**20) -> float:
    """Bytes read plus bytes written per second by a large fp32 copy."""
    source, target = torch.ones(numel), torch.empty(numel)
    return 2 * 4 * numel / _best_of(3, lambda: target.copy_(source))


def optimizer_seconds(kind: str, fused: bool = False, numel: int = 2 * 2**20) -> float:
    """Seconds per fp32 element of one step of torch's optimizer (its for-loop or its fused kernel) over masters in
    host memory cut as the engine cuts them (See [Note: optimizer pieces] in zerokit/masters/shards.py)."""
    size = min(numel, optimizer_piece_numel(None, master_on_host=True, fused=fused))
    pieces = [torch.nn.Parameter(torch.randn(size)) for _ in range(numel // size)]
    for piece in pieces:
        piece.grad = torch.randn_like(piece)
    return _best_of(3, torch_optimizer(kind, pieces, fused).step) / numel


OPTIMIZER_KINDS = ("adamw", "adam", "sgd", "sgd-momentum")  # what a run record names (record.optimizer_name)


def torch_optimizer(kind: str, params: Any, fused: bool = False) -> torch.optim.Optimizer:
    """torch's optimizer for one of OPTIMIZER_KINDS: its default implementation, or its fused kernel."""
    check_optimizer_kind(kind)
    if kind in ("adamw", "adam"):
        return (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(params, fused=fused or None)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9 if kind == "sgd-momentum" else 0.0, fused=fused or None)


def check_optimizer_kind(kind: str) -> None:
    if kind not in OPTIMIZER_KINDS:
        raise ValueError(f"optimizer={kind!r} is not timed here; use one of {', '.join(OPTIMIZER_KINDS)}")


def _link_rank(rank: int, world: int) -> dict:
    """In each spawned rank: the framework's resident memory, then all-reduce times at two sizes."""
    import zerokit  # noqa: F401  (what a training script imports, so that it is resident)

    if importlib.util.find_spec("transformers"):
        import transformers  # noqa: F401
    warm = torch.nn.Linear(64, 64)
    warm(torch.randn(8, 64)).sum().backward()
    dist.all_reduce(torch.zeros(1024))
    gc.collect()
    resident = resident_bytes()
    times = {}
    for numel in (2**14, 2**23):
        tensor = torch.zeros(numel)
        dist.barrier()
        times[numel] = _best_of(5, lambda t=tensor: dist.all_reduce(t))
    return {"resident": resident, "times": times}


def link_numbers(world: int) -> tuple[float, float, int]:
    """(bandwidth bytes/s, latency s per ring step, resident bytes) from all-reduces between `world` ranks:
    time = 2(n-1) x latency + 2(n-1)/n x bytes / bandwidth, solved from a small and a large size."""
    from zerokit.testing.spawn import spawn

    result = spawn(_link_rank, world)[0]
    (small, t_small), (large, t_large) = sorted(result["times"].items())
    factor, steps = 2 * (world - 1) / world, 2 * (world - 1)
    bandwidth = factor * 4 * (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - factor * 4 * small / bandwidth, 0.0) / steps
    return bandwidth, latency, result["resident"]


def measure_device(threads: int = 1, world: int = 2, name: str = "this CPU") -> DeviceProfile:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = {key: matmul_flops(dtype) for key, dtype in DTYPES.items()}
        flops["fp16"] = flops["bf16"]  # the CPU runs both 16-bit types through the same kernels' speed class
        bandwidth = copy_bandwidth()
        optimizer = {optimizer_key(kind, fused): optimizer_seconds(kind, fused)
                     for kind in ("adamw", "sgd-momentum", "sgd") for fused in (False, True)}
        for fused in (False, True):
            optimizer[optimizer_key("adam", fused)] = optimizer[optimizer_key("adamw", fused)]
    finally:
        torch.set_num_threads(previous)
    link, latency, resident = link_numbers(world)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return DeviceProfile(name=name, peak_flops=flops, memory_bandwidth=bandwidth, link_bandwidth=link,
                         link_latency=latency, optimizer_seconds_per_element=optimizer, resident_bytes=resident,
                         memory_bytes=memory,
                         threads=threads, source=f"measured on this machine with {threads} thread(s) per rank, "
                                                 f"{world} gloo ranks (zerokit plan --measure-device)")
