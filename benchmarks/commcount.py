"""Bytes every contender sends, counted the same way for all, at torch's c10d operators.

zerokit counts its own collectives (`engine.comm_stats()`), but the peers have no such counter.
Every torch.distributed collective, whoever calls it (DDP's C++ reducer, FSDP2, DeepSpeed's comm
layer, zerokit), reaches the dispatcher as a `torch.ops.c10d.*` operator, and a TorchDispatchMode
sees each one with its tensors, as torch's own CommDebugMode does. Counting in the mode costs Python
time on every operator, so the harness runs one extra, untimed step under it after the timed ones
(every step sends the same). Each call is counted in zerokit's convention (comm/collectives.py): the
whole logical tensor, i.e. the tensor of an all-reduce or broadcast, the full input of a
reduce-scatter, the full output of an all-gather.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerokit.config.settings import ring_share

c10d = torch.ops.c10d
# operator -> (the collective it is, which argument holds the logical tensor(s))
COLLECTIVES: dict[Any, tuple[str, int]] = {
    c10d.allreduce_.default: ("all_reduce", 0),
    c10d.allreduce_coalesced_.default: ("all_reduce", 0),
    c10d.broadcast_.default: ("broadcast", 0),
    c10d.reduce_.default: ("reduce", 0),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    c10d.reduce_scatter_.default: ("reduce_scatter", 1),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1),
    c10d._allgather_base_.default: ("all_gather", 0),
    c10d.allgather_.default: ("all_gather", 0),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0),
}
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
# Bytes one rank sends per logical byte on a ring of N ranks (a reduce to one rank: as a reduce-scatter): the
# engine's own rule, zerokit/config/settings.py's ring_share.
RING_FACTOR = {kind: (lambda n, kind=kind: float(ring_share(kind, n))) for kind in KINDS}


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter() as counter:` ... `counter.counts[kind]` = calls, elements, bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {kind: {"calls": 0, "elements": 0, "bytes": 0} for kind in KINDS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in COLLECTIVES:
            kind, position = COLLECTIVES[func]
            tensors = [t for t in tree_leaves(args[position]) if isinstance(t, torch.Tensor)]
            count = self.counts[kind]
            count["calls"] += 1
            count["elements"] += sum(t.numel() for t in tensors)
            count["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))
