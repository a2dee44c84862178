"""What an NVMe read-ahead guesses: the chunk read after each one last time, learned as chunks are read. Pure
Python: NvmeShards (nvme_shards.py) starts its reads ahead from it, and the planner (planner/engine_offload.py)
counts the same reads from it."""

from __future__ import annotations

from typing import Generic, Hashable, TypeVar

Key = TypeVar("Key", bound=Hashable)


class ReadOrder(Generic[Key]):
    def __init__(self) -> None:
        self.following: dict[Key, Key] = {}  # chunk -> the chunk read after it last time
        self.last: Key | None = None

    def read(self, key: Key) -> Key | None:
        """Note a read of `key`; the chunk to read ahead now: the one that followed `key` last time (None where
        none did, or `key` itself did)."""
        if self.last is not None and self.last != key:
            self.following[self.last] = key
        self.last = key
        ahead = self.following.get(key)
        return None if ahead is None or ahead == key else ahead


__all__ = ["ReadOrder"]
