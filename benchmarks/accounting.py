"""What a rank holds: model-state bytes counted from tensors, peak RSS, and the ZeRO paper's formula.

[Note: counting storages, not tensors]
A peer's parameters and gradients are often views into flat buffers (DDP's gradient buckets,
DeepSpeed's flattened fp32 groups), and the same buffer can be reached from two places (a
parameter and the flat group it lives in). So bytes are counted per distinct storage, and a storage
is counted once, in the first category that reaches it, in the order parameters, gradients,
optimizer state. A view into a big buffer counts the whole buffer: that is what the rank holds.

[Note: peak RSS growth]
Peak memory is the growth of the process's resident high-water mark (VmHWM in /proc/self/status)
over its resident size just before the model is built. Just before that point the high-water mark
is reset to the current RSS by writing "5" to /proc/self/clear_refs (Linux >= 4.0), so imports, the
process-group set-up and a peer's own import cost are not counted, and a transient peak during
them cannot hide the training peak. Where clear_refs is not writable, `ru_maxrss` (the same
high-water mark, never reset) is used instead and the result says so: then the growth is a lower
bound whenever start-up peaked above the baseline. RSS, not tensor bytes, is what the operating
system charges the rank: it includes activations, communication buffers and allocator slack.
"""

from __future__ import annotations

import gc
import resource
import warnings
from pathlib import Path
from typing import Iterable, NamedTuple

import torch

from zerokit.profiling.measure import status_bytes

CATEGORIES = ("parameters", "gradients", "optimizer_state")

# Bytes per trainable parameter (parameters, gradients, optimizer state) of Adam training, and which
# of them ZeRO stage s shards. ZeRO paper (Rajbhandari et al. 2020), section 3 and figure 1.
BYTES_PER_PARAM = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}  # bf16: fp32 master 4 + Adam m, v 8
SHARDED_BY_STAGE = {0: (False, False, False), 1: (False, False, True),
                    2: (False, True, True), 3: (True, True, True)}


def formula_bytes(numel: int, dtype: str, stage: int, world_size: int) -> dict[str, float]:
    """The ZeRO paper's model-state bytes per rank, by category."""
    per_param = BYTES_PER_PARAM[dtype]
    sharded = SHARDED_BY_STAGE[stage]
    return {category: numel * size / (world_size if is_sharded else 1)
            for category, size, is_sharded in zip(CATEGORIES, per_param, sharded)}


def _leaves(item) -> Iterable[torch.Tensor]:
    """Tensors inside nested dicts, lists and tuples (DeepSpeed keeps gradients in such containers)."""
    if isinstance(item, torch.Tensor):
        yield item
    elif isinstance(item, dict):
        for value in item.values():
            yield from _leaves(value)
    elif isinstance(item, (list, tuple)):
        for value in item:
            yield from _leaves(value)


def storage_bytes(parameters=(), gradients=(), optimizer_state=()) -> dict[str, int]:
    """Bytes of the distinct storages reached from each category. See [Note: counting storages, not tensors]."""
    seen: set[int] = set()
    counted = {}
    for category, items in zip(CATEGORIES, (parameters, gradients, optimizer_state)):
        total = 0
        for tensor in _leaves(list(items)):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        counted[category] = total
    return counted


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage reachable from a Python tensor object in this process: an
    independent upper check on the per-category counts (it also sees data and buffers, but not
    tensors that live only in C++, such as DDP's own buckets)."""
    gc.collect()
    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module attributes warns
        warnings.simplefilter("ignore", FutureWarning)
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, ReferenceError):  # meta, sparse or freed (FSDP's resized) storages, dead proxies
            continue
        if pointer not in seen:
            seen.add(pointer)
            total += storage.nbytes()
    return total


class PeakMemory(NamedTuple):
    baseline: int  # resident bytes just before the model is built
    method: str  # "VmHWM (reset via clear_refs)" or "ru_maxrss (not reset)"


def start_peak_memory() -> PeakMemory:
    """Reset the high-water mark and take the baseline. See [Note: peak RSS growth]."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return PeakMemory(status_bytes("VmRSS"), "VmHWM (reset via clear_refs)")
    except OSError:
        return PeakMemory(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss (not reset)")


def peak_growth(start: PeakMemory) -> int:
    if start.method.startswith("VmHWM"):
        return status_bytes("VmHWM") - start.baseline
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start.baseline
