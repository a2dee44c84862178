"""`deepspeed.accelerator.get_accelerator()` for zerokit: the device zerokit trains on, with the methods
training scripts call on DeepSpeed's accelerator object, on the CPU and on CUDA.

The CPU answers as DeepSpeed's CPU accelerator does (device name 'cpu', memory as the process's resident set
size, synchronize a no-op, device_count() LOCAL_SIZE if set, else 1 where DeepSpeed counts NUMA nodes), except
that current_device() is LOCAL_RANK as an int (DeepSpeed returns the environment string). A method DeepSpeed has and
zerokit does not is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from zerokit.deepspeed.distributed import backend_name


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class Accelerator:
    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"
        self._cuda = self._name == "cuda"
        self._peak_rss = 0

    # --- devices ------------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def device(self, device_index: int | None = None) -> Any:
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", 1))  # DeepSpeed: LOCAL_SIZE, else its NUMA nodes (1 here)

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def communication_backend_name(self) -> str:
        return backend_name()

    def get_compile_backend(self) -> str:
        return "inductor"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    # --- random numbers -------------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._cuda else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    # --- memory ------------------------------------------------------------------------------------------
    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        rss = _rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return max(self._peak_rss, self.memory_allocated())

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else _rss()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = _rss()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        import psutil

        return psutil.virtual_memory().available

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    # --- streams, events, markers ---------------------------------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"get_accelerator().{name}() is not offered by zerokit's accelerator (it covers the "
                             "device, random-number, memory and stream calls training scripts make)")


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator of this process (one object, as DeepSpeed's)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR


__all__ = ["Accelerator", "get_accelerator"]
