"""A device the catalogue does not list (a CPU, or any machine), described by measured numbers.

`zerokit plan --measure-device` (zerokit/profiling/device.py) times, on the local machine with the
given threads per rank: dense matmuls per compute dtype (peak FLOPs), a large copy (memory bandwidth),
torch's optimizer stepping fp32 masters in the engine's pieces (seconds per element), and, between two
gloo ranks on this host, all-reduces of two sizes (latency and bandwidth, the alpha-beta model of
comms.py), and the resident memory of a rank that has joined its process group (the framework's share).
Every number can also be given by hand; the source says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

from zerokit._support.jsonfile import JsonRecord


def optimizer_key(kind: str, fused: bool) -> str:
    """A DeviceProfile's key for optimizer `kind` (adamw, sgd-momentum, ...) stepped by its for-loop or its fused
    kernel, whose host pieces differ (See [Note: optimizer pieces] in zerokit/masters/shards.py)."""
    return f"{kind} fused" if fused else kind


@dataclass(frozen=True)
class DeviceProfile(JsonRecord):
    WHAT: ClassVar[str] = "device file"
    HINT: ClassVar[str] = "write one with zerokit plan --measure-device"

    name: str
    peak_flops: dict[str, float]
    """Dense matmul FLOP/s per compute dtype (fp32, bf16, fp16), per rank."""
    memory_bandwidth: float
    """bytes/s of a large copy (read + write), per rank."""
    link_bandwidth: float
    """bytes/s each rank sends in a ring collective between the ranks (per direction)."""
    link_latency: float
    """seconds per ring step."""
    optimizer_seconds_per_element: dict[str, float] = field(default_factory=dict)
    """Per optimizer (adamw, sgd-momentum, ...; "adamw fused": torch's fused kernel, See optimizer_key): seconds to
    step one fp32 master element."""
    resident_bytes: int = 0
    """Resident memory of one rank after joining its process group, before building a model."""
    memory_bytes: int = 0
    """Memory the ranks of one machine share (a CPU's RAM); 0: not known."""
    threads: int = 1
    source: str = "measured by zerokit plan --measure-device"

    def __post_init__(self) -> None:
        for name in ("memory_bandwidth", "link_bandwidth"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"device {name}={value!r} must be > 0 and finite")
        if not self.peak_flops or any(not 0 < v < math.inf for v in self.peak_flops.values()):
            raise ValueError(f"device peak_flops={self.peak_flops!r} needs a positive FLOP/s per dtype")

    def flops(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ValueError(f"device {self.name} has no measured {precision} peak; measured: "
                             f"{', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[precision]

    def with_overrides(self, **given: float | None) -> DeviceProfile:
        """Replace any measured number by the user's (None: keep it)."""
        changes = {k: v for k, v in given.items() if v is not None}
        if "peak_flops" in changes and not isinstance(changes["peak_flops"], dict):
            changes["peak_flops"] = {k: changes["peak_flops"] for k in self.peak_flops}
        if not changes:
            return self
        note = ", ".join(sorted(changes))
        return replace(self, source=f"{self.source}; user override of {note}", **changes)

