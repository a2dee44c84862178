"""zerokit/tiers/pinned.py: page-locked host buffers of exactly the size asked for, locked as long as a tensor over
them lives. The CUDA runtime is stood in for here (no GPU on CI); tests/test_cuda.py checks the real one."""

from __future__ import annotations

import gc

import pytest
import torch

from zerokit.tiers import pinned


class FakeRuntime:
    def __init__(self, refuse: bool = False) -> None:
        self.locked: dict[int, int] = {}
        self.refuse = refuse

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        if self.refuse:
            return 2  # cudaErrorMemoryAllocation
        assert address % 4096 == 0 and address not in self.locked
        self.locked[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.locked.pop(address)
        return 0


@pytest.fixture
def runtime(monkeypatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_the_bytes_locked_are_the_bytes_asked_for_until_the_last_view_goes(runtime) -> None:
    buffer = pinned.host_buffer(3 * 2**20 + 5, dtype=torch.bfloat16, pin=True, zeroed=True)
    assert buffer.dtype == torch.bfloat16 and buffer.numel() == 3 * 2**20 + 5 and not buffer.any()
    assert list(runtime.locked.values()) == [(3 * 2**20 + 5) * 2]  # torch's allocator would lock 8 MiB
    assert list(runtime.locked) == [buffer.data_ptr()]
    piece = buffer[100:200]
    del buffer
    gc.collect()
    assert runtime.locked, "unlocked while a view of the buffer still lives"
    piece.fill_(1.0)
    del piece
    gc.collect()
    assert runtime.locked == {}


def test_unpinned_and_empty_buffers_lock_nothing(runtime) -> None:
    assert pinned.host_buffer(10, pin=False).numel() == 10
    assert pinned.host_buffer(0, pin=True).numel() == 0
    assert runtime.locked == {}
