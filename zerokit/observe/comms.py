"""DeepSpeed's comms_logger: what the engine's collectives moved, per optimizer step (engine.comm_stats()
differences), and with `verbose` every collective as it is issued, with its caller under `debug`.

Every collective zerokit issues is counted by one object, the CommStats its Communicators share
(zerokit/comm/collectives.py), so a CommStats that also logs each record sees them all: the engine passes one
to its Communicator at construction when the config asks for verbose logging; nothing is patched.

`prof_ops` takes DeepSpeed's operation names (deepspeed.comm function names); those naming an operation
zerokit never issues (all_to_all_single, send, barrier, ...) are accepted and simply never appear.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerokit.comm.counting import Collective, CommStats, Transfer
from zerokit.config.dsconfig.blocks import CommsLogger
from zerokit._support.log import logger


DEEPSPEED_OPS: dict[str, Collective | None] = {
    "all_reduce": Collective.ALL_REDUCE, "all_reduce_coalesced": Collective.ALL_REDUCE,
    "inference_all_reduce": Collective.ALL_REDUCE,
    "all_gather": Collective.ALL_GATHER, "all_gather_into_tensor": Collective.ALL_GATHER,
    "allgather_fn": Collective.ALL_GATHER, "all_gather_base": Collective.ALL_GATHER,
    "all_gather_coalesced": Collective.ALL_GATHER,
    "reduce_scatter": Collective.REDUCE_SCATTER, "reduce_scatter_tensor": Collective.REDUCE_SCATTER,
    "reduce_scatter_fn": Collective.REDUCE_SCATTER, "reduce_scatter_base": Collective.REDUCE_SCATTER,
    "broadcast": Collective.BROADCAST, "reduce": Collective.REDUCE,
    **{name: None for name in ("all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv", "barrier",
                               "monitored_barrier", "gather", "scatter", "broadcast_object_list",
                               "all_gather_object", "batch_isend_irecv")},
}


def logged_kinds(spec: CommsLogger) -> frozenset[Collective | Transfer]:
    """The kinds to report: with prof_all every collective and every offload transfer, else the collectives
    prof_ops names."""
    if spec.prof_all:
        return frozenset((*Collective, *Transfer))
    unknown = [name for name in spec.prof_ops if name not in DEEPSPEED_OPS]
    if unknown:
        raise ValueError(f"comms_logger.prof_ops names {unknown[0]!r}, which is not a deepspeed.comm operation; "
                         f"accepted: {', '.join(sorted(DEEPSPEED_OPS))}")
    return frozenset(kind for name in spec.prof_ops if (kind := DEEPSPEED_OPS[name]) is not None)


@dataclass
class LoggedCommStats(CommStats):
    """CommStats that also logs each collective it counts (comms_logger.verbose), on rank 0."""

    rank: int = 0
    kinds: frozenset[Collective | Transfer] = field(default_factory=frozenset)
    debug: bool = False

    def record(self, kind: Collective | Transfer, tensor: torch.Tensor, group: str = "",
               ring_share: float = 0.0) -> None:
        super().record(kind, tensor, group, ring_share)
        if self.rank == 0 and kind in self.kinds:
            caller = f" | caller {_caller()}" if self.debug else ""
            logger.info(f"comm op: {kind.value} | {tensor.numel():,} elements of {str(tensor.dtype)[6:]} | "
                        f"{tensor.numel() * tensor.element_size():,} bytes{caller}")


def _caller() -> str:
    """The first frame outside zerokit/comm and this module: the code that asked for the collective."""
    frame = sys._getframe(2)
    while frame is not None and ("zerokit/comm/" in frame.f_code.co_filename
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    short = path[path.rfind("zerokit/"):] if "zerokit/" in path else path
    return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"


def collective_stats(spec: CommsLogger) -> CommStats | None:
    """The CommStats the engine's Communicator (over the default group, already joined) should count in: a
    logging one for comms_logger.verbose, else None (the Communicator's own)."""
    if not (spec.enabled and spec.verbose):
        return None
    return LoggedCommStats(dist.get_world_size(), rank=dist.get_rank(), kinds=logged_kinds(spec), debug=spec.debug)


class CommsReport:
    """comm_stats() differences per optimizer step, for the kinds asked for."""

    def __init__(self, spec: CommsLogger, since: dict[str, dict[str, int]]) -> None:
        """`since`: comm_stats() when training starts (construction's broadcasts are not a step's)."""
        self.kinds = {kind.value for kind in logged_kinds(spec)}
        self.before = since

    def line(self, step: int, stats: dict[str, dict[str, int]]) -> str:
        parts = []
        for kind, count in stats.items():
            moved = {name: value - self.before.get(kind, {}).get(name, 0) for name, value in count.items()}
            if kind in self.kinds and moved["calls"]:
                parts.append(f"{kind} {moved['calls']} calls, {moved['elements']:,} elements, {moved['bytes']:,} bytes")
        self.before = {kind: dict(count) for kind, count in stats.items()}
        return f"step {step} collectives | " + ("; ".join(parts) if parts else "none")


__all__ = ["DEEPSPEED_OPS", "logged_kinds", "LoggedCommStats", "collective_stats", "CommsReport"]
