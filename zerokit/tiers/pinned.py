"""Page-locked host buffers of the size asked for (issue 34).

[Note: pinned memory of the size asked for]
torch's pinned-memory allocator (`torch.empty(..., pin_memory=True)`, `tensor.pin_memory()`) rounds every request up
to the next power of two, to reuse its blocks. For an offload tier that is most of host memory: a 4.5B-parameter
Llama's fp32 master and gradient buffers (18 GB each) became 32 GiB each, and stage 3 with everything offloaded
peaked at 101.8 GiB of RSS on an H200's host (benchmarks/bench_offload_gpu.py largest, 2026-11-27). A buffer that
lives as long as its engine gains nothing from the allocator's reuse, so on CUDA `host_buffer` takes pages of its
own (an anonymous mapping: no other tensor shares a page, and CUDA refuses a page registered twice) and page-locks
exactly them with cudaHostRegister, unlocking them when the last tensor over them is collected. torch treats the
memory as pinned (`is_pinned()`; its copies from it are asynchronous), and zerokit orders those copies itself with
events on the copy stream (See zerokit/tiers/copies.py). Without CUDA there is nothing to lock: ordinary memory.
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch


def host_buffer(numel: int, dtype: torch.dtype = torch.float32, pin: bool = False,
                zeroed: bool = False) -> torch.Tensor:
    """A 1-D host tensor of `numel` elements, page-locked where `pin` and CUDA is here (See [Note: pinned memory of
    the size asked for]); zeroed if asked (else uninitialised)."""
    if not (pin and torch.cuda.is_available()) or numel == 0:
        return (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    pages = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)  # pages of its own, zero-filled by the kernel
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(pages.ctypes.data, nbytes, 0)) != 0:
        # the driver refused (a locked-memory limit, say): torch's allocator, which may round up
        pinned = torch.empty(numel, dtype=dtype, pin_memory=True)
        return pinned.zero_() if zeroed else pinned
    # unlocked when the last tensor over these pages goes (torch holds the array; numpy calls this before unmapping)
    weakref.finalize(pages, cudart.cudaHostUnregister, pages.ctypes.data)
    return torch.from_numpy(pages).view(dtype)
