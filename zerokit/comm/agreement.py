"""Small agreements between ranks, on CPU tensors over the control group (Communicator.control): do all ranks
hold the same values, what is the smallest and largest proposal, and, when they differ, what each rank holds.
The fast path is one all-reduce of a few int64s; only a disagreement pays for gathering the details."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerokit.comm.collectives import Communicator

MAX_KEY = (1 << 62) - 1  # keys are kept below 2**62 so that their negation fits an int64


def min_max(comm: Communicator, keys: list[int], purpose: str) -> tuple[list[int], list[int]]:
    """The element-wise minimum and maximum of `keys` (each in [-MAX_KEY, MAX_KEY]) over the ranks: one
    all-reduce (MIN) of the keys and their negations."""
    if any(abs(key) > MAX_KEY for key in keys):
        raise ValueError(f"rank {comm.rank}: agreement keys must be within +-2**62, got {keys}")
    packed = torch.tensor([*keys, *(-key for key in keys)], dtype=torch.int64)
    comm.all_reduce(packed, op=dist.ReduceOp.MIN, purpose=purpose)
    values = packed.tolist()
    return values[:len(keys)], [-value for value in values[len(keys):]]


def all_gather_bytes(comm: Communicator, data: bytes, purpose: str) -> list[bytes]:
    """Every rank's `data`, in rank order: the longest length (one all-reduce), then every rank's bytes padded
    to it (one all-gather)."""
    (longest,), _ = min_max(comm, [-len(data)], purpose=f"{purpose}: lengths")
    width = -longest + 8  # 8 bytes of length in front of each rank's data
    row = torch.zeros(width, dtype=torch.uint8)
    row[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    row[8:8 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    table = torch.empty(width * comm.world_size, dtype=torch.uint8)
    comm.all_gather(table, row, purpose=purpose)
    rows = [bytes(chunk.tolist()) for chunk in table.chunk(comm.world_size)]
    return [chunk[8:8 + int.from_bytes(chunk[:8], "little")] for chunk in rows]
