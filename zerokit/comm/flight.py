"""The flight recorder: the last collectives this rank issued, so that a hang or a failure report shows where
each rank stood.

[Note: the flight recorder]
Every collective a Communicator issues is one FlightEntry in a ring buffer shared by the engine's process
groups (the shard group, stage 3's gather group, the control group): its group and sequence number on that
group, kind, size, purpose (what the caller said it was for: "gradients: bucket 3 of param group 0", "unit
'blocks.3'", "the boundary norm"), and wall-clock start and end times (time.time(), so that the files of
several ranks can be read side by side). Sequence numbers count per group and per rank, so two ranks that
issued the same collectives show the same numbers: where they differ is where the ranks parted. Recording
costs one small object and two clock reads per collective; the ring keeps the last `capacity` (64).

On a failure (zerokit/comm/deadline.py) the ring is written to a JSON file, one per rank (ZEROKIT_FLIGHT_DIR,
else the temporary directory; named by rank, process and the engine's group), and its last lines go into the
error message.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

FLIGHT_CAPACITY = 64  # collectives kept per rank: about two steps of a 6-unit stage-3 model
FLIGHT_DIR_ENV = "ZEROKIT_FLIGHT_DIR"


@dataclass
class FlightEntry:
    group: str  # "shard", "gather", "control"
    sequence: int  # this collective's number on its group, from 1, on this rank
    kind: str  # all_reduce, all_gather, ...
    numel: int
    nbytes: int
    purpose: str  # what the caller said it was for ("" when it said nothing)
    start: float  # time.time() when issued
    end: float | None = None  # time.time() when a wait on it returned; None while it has not
    error: str | None = None  # why it failed, if it did

    def name(self) -> str:
        """`all_reduce #12 on the shard group (the boundary norm)`."""
        purpose = f" ({self.purpose})" if self.purpose else ""
        return f"{self.kind} #{self.sequence} on the {self.group} group{purpose}"

    def line(self, now: float) -> str:
        """One line of a report: what, how big, and when (relative to `now`)."""
        if self.error is not None:
            state = f"failed: {self.error}"
        elif self.end is None:
            state = f"issued {now - self.start:.2f} s ago, not complete"
        else:
            state = f"took {self.end - self.start:.3f} s, completed {now - self.end:.2f} s ago"
        return f"{self.name()}, {self.numel:,} elements, {state}"


class FlightRecorder:
    """The ring of the last collectives of one rank (See [Note: the flight recorder])."""

    def __init__(self, rank: int, job: str, capacity: int = FLIGHT_CAPACITY) -> None:
        self.rank, self.job = rank, job  # job: the engine's process group name, the same on every rank
        self.entries: deque[FlightEntry] = deque(maxlen=capacity)

    def begin(self, group: str, sequence: int, kind: str, numel: int, nbytes: int, purpose: str) -> FlightEntry:
        entry = FlightEntry(group, sequence, kind, numel, nbytes, purpose, time.time())
        self.entries.append(entry)
        return entry

    def last_completed(self, count: int) -> list[FlightEntry]:
        """The last `count` collectives whose wait returned, oldest first."""
        done = [entry for entry in self.entries if entry.end is not None and entry.error is None]
        return done[-count:]

    def in_flight(self) -> list[FlightEntry]:
        """Collectives issued and not (yet) seen complete, oldest first."""
        return [entry for entry in self.entries if entry.end is None]

    def dump(self, reason: str) -> Path | None:
        """Write the ring, with `reason`, to this rank's file; returns its path (None if it cannot be written)."""
        directory = Path(os.environ.get(FLIGHT_DIR_ENV) or tempfile.gettempdir())
        path = directory / f"zerokit-flight-rank{self.rank}-pid{os.getpid()}-group{self.job}.json"
        document = {"rank": self.rank, "pid": os.getpid(), "written": time.time(), "reason": reason,
                    "collectives": [asdict(entry) for entry in self.entries]}
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(document, indent=1) + "\n")
        except OSError:
            return None
        return path
