"""Bytes a peer's rank sends to ranks on other simulated nodes, counted as zerokit counts its own (See [Note: bytes
that cross nodes] in zerokit/comm/collectives.py), for the benchmarks that run DeepSpeed or torch beside zerokit.

Python imports this module at start-up when its folder is on PYTHONPATH (benchmarks/bench_pipeline.py puts it there
for the peers' ranks only, with ZEROKIT_WIRE_OUT and ZEROKIT_WIRE_RANKS_PER_NODE set), so the peer's script runs as it
is. It wraps torch.distributed's point-to-point sends (a send to a rank on another node counts its bytes) and
collectives (a ring over the group in ascending ranks: this rank's ring share of the logical bytes counts where the
next rank is on another node, as zerokit.config.settings.ring_crosses_nodes says), and at exit writes
ZEROKIT_WIRE_OUT/rank<r>.json: {"bytes": ..., "calls": ..., "by": {function: bytes}}, start-up included.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import threading
from pathlib import Path

LOGICAL = {  # collective -> the argument whose tensor is its logical size (zerokit's convention)
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_tensor": "input", "all_gather": "tensor", "reduce_scatter": "output",
}
SENDS = ("send", "isend")


def _install(out: Path, ranks_per_node: int) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from zerokit.config.settings import ring_crosses_nodes, ring_share
    counted = {"bytes": 0.0, "calls": 0, "rank": None, "by": {}}

    def add(name: str, size: float) -> None:
        counted["bytes"] += size
        counted["calls"] += 1
        counted["by"][name] = counted["by"].get(name, 0.0) + size

    def group_ranks(group) -> list[int]:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)

    def count_send(arguments: dict) -> None:
        group, peer = arguments.get("group"), arguments.get("dst")
        if peer is None and arguments.get("group_dst") is not None:
            peer = dist.get_global_rank(group, arguments["group_dst"])
        if peer is not None and peer // ranks_per_node != dist.get_rank() // ranks_per_node:
            tensor = arguments["tensor"]
            add("send", tensor.numel() * tensor.element_size())

    def count_collective(name: str, arguments: dict) -> None:
        ranks = group_ranks(arguments.get("group"))
        me = dist.get_rank()
        if len(ranks) < 2 or me not in ranks or not ring_crosses_nodes(ranks, me, ranks_per_node):
            return
        tensor = arguments[LOGICAL[name]]
        size = tensor.numel() * tensor.element_size() * (len(ranks) if name in ("all_gather", "reduce_scatter")
                                                         else 1)
        kind = "all_reduce" if name == "all_reduce" else "all_gather"
        add(name, float(ring_share(kind, len(ranks))) * size)

    inside = threading.local()
    inside.depth = 0

    def wrap(name: str):
        original = getattr(c10d, name)
        signature = inspect.signature(original)

        def counting(*args, **kwargs):
            if dist.is_initialized() and not inside.depth:  # torch's send calls isend: count the outer call only
                counted["rank"] = dist.get_rank()
                arguments = signature.bind(*args, **kwargs).arguments
                (count_send if name in SENDS else lambda a: count_collective(name, a))(arguments)
            inside.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                inside.depth -= 1

        counting.__wrapped__ = original
        counting.__name__ = original.__name__
        setattr(c10d, name, counting)
        setattr(dist, name, counting)

    for name in (*SENDS, *LOGICAL):
        wrap(name)

    def write() -> None:
        if counted["rank"] is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{counted['rank']}.json").write_text(json.dumps({
                "bytes": round(counted["bytes"]), "calls": counted["calls"],
                "by": {name: round(size) for name, size in counted["by"].items()}}))

    atexit.register(write)


if os.environ.get("ZEROKIT_WIRE_OUT") and os.environ.get("ZEROKIT_WIRE_RANKS_PER_NODE"):
    _install(Path(os.environ["ZEROKIT_WIRE_OUT"]), int(os.environ["ZEROKIT_WIRE_RANKS_PER_NODE"]))
