"""Signs of life: each rank posts, a few times a second, that it is alive and the last collective it completed, so
that a rank that fails in a collective can name the peer that went silent, and where that peer stood.

[Note: naming the rank that went silent]
A rank that dies in the middle of a job (SIGKILL, a GPU off the bus, a node gone) or freezes (SIGSTOP, a hung
driver) leaves its peers in a collective. gloo notices a death at once ("Connection reset by peer") but names no
rank; nothing notices a frozen rank, or a dead one on NCCL, until the deadline (See [Note: deadlines on
collectives] in deadline.py). Either way the failure report exchange (deadline.py) already hears from every rank
still in zerokit's hands; what it could not say is which rank is gone, and since when. So:
  - a daemon thread per engine (`Heartbeat`, started with its first Communicator) writes one key of the job's
    store, `zerokit/alive/<incident>/<rank>`, every HEARTBEAT_SECONDS: the time, and the last collective this rank
    completed. One small store write; no collective, no tensor, nothing on the training thread;
  - a failing rank reads every peer's key as it starts its report and again at the end of the grace period (1 s at
    least, two beats): a rank that sent no report and posted no new sign in between went silent (dead, frozen, or
    its process wedged with the GIL held); one that posted is alive and stalled outside zerokit's collectives (data
    loading, a deadlock in user code). Two readings, not the age of one: a rank killed a moment ago has a recent
    sign, and a busy machine may delay a live one's;
  - the error's first line names them, with their last completed collective (`headline`), so that a launcher's
    log shows in one line which rank to look at; `torchrun --max-restarts` restarts as soon as the process exits.
The store is the one the job's group started in: torchrun's agent hosts it, so it outlives any worker; a job
started without torchrun keeps it in rank 0, and if rank 0 is the one that died its peers say so ("the key-value
store failed"). A store that fails stops the thread quietly: the deadline still holds. The collective a sign names is
the last one completed when it was posted, up to one beat before the rank went silent. What it costs: at 1,024 ranks,
about 2,000 small writes a second on the store (TCPStore serves tens of thousands); a failing rank reads two keys per
peer, once.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from zerokit.comm.flight import FlightRecorder

HEARTBEAT_SECONDS = 0.5  # how often a rank posts its sign of life: half the shortest grace of a report


def default_store() -> dist.Store | None:
    """The store the job's default group started in (where failure reports and signs of life meet)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not initialised by a store this process can reach, or a torch without it
        return None


def heartbeat_key(incident: str, rank: int) -> str:
    return f"zerokit/alive/{incident}/{rank}"


_running: "weakref.WeakSet[Heartbeat]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Every heartbeat still running stops before the interpreter finalizes: an engine let go of without close()
    leaves its thread running, and a daemon thread that finalization stops inside the store's C++ call aborts the
    process ("terminate called without an active exception")."""
    beats = list(_running)
    for beat in beats:
        beat.stopping.set()
    for beat in beats:
        beat.thread.join(timeout=2 * beat.period)


class Heartbeat:
    """The thread that posts this rank's sign of life (See [Note: naming the rank that went silent])."""

    def __init__(self, store: dist.Store, recorder: FlightRecorder, incident: str,
                 period: float = HEARTBEAT_SECONDS) -> None:
        self.store, self.recorder, self.period = store, recorder, period
        self.key = heartbeat_key(incident, recorder.rank)
        self.stopping = threading.Event()
        self.beat()  # a sign before the first collective, so that a rank dead at its first one is named too
        self.thread = threading.Thread(target=self._run, name="zerokit-heartbeat", daemon=True)
        self.thread.start()
        _running.add(self)

    def beat(self) -> bool:
        """Post one sign; False if the store failed (then the thread ends)."""
        entries = list(self.recorder.entries)  # copied in one step under the GIL: the training thread appends
        done = [entry for entry in entries if entry.end is not None and entry.error is None]
        last = done[-1].name() if done else "none"
        try:
            self.store.set(self.key, f"{time.time():.3f} {last}")
        except Exception:  # the store's host is gone or the group was torn down
            return False
        return True

    def stop(self) -> None:
        """End the thread (its engine is closed); a store call in flight may take a moment: wait for it briefly."""
        self.stopping.set()
        self.thread.join(timeout=2 * self.period)

    def _run(self) -> None:
        while not self.stopping.wait(self.period) and self.beat():
            pass


@dataclass(frozen=True)
class SignOfLife:
    """What a rank's heartbeat key showed over the grace period of a failure report."""

    rank: int
    age: float | None  # seconds since its last sign when last read; None: it never posted one
    last_completed: str  # "none" when it had completed nothing, "unknown" when it never posted
    silent: bool  # no new sign over the grace period

    def describe(self) -> str:
        """`rank 1 went silent (its last sign of life 1.2 s ago, having completed all_reduce #41 on ...)`."""
        if self.age is None:
            return f"rank {self.rank} went silent before its first sign of life"
        when = f"its last sign of life {self.age:.1f} s ago, having completed {self.last_completed}"
        return f"rank {self.rank} went silent ({when})" if self.silent else f"rank {self.rank} is alive ({when})"


def read_beats(store: dist.Store, incident: str, ranks: list[int]) -> dict[int, str | None]:
    """What each of `ranks` last posted (None: nothing yet), read now."""
    keys = {rank: heartbeat_key(incident, rank) for rank in ranks}
    return {rank: store.get(key).decode() if store.check([key]) else None for rank, key in keys.items()}


def signs_of_life(before: dict[int, str | None], after: dict[int, str | None]) -> list[SignOfLife]:
    """The ranks of `after` as two readings of their keys show them: a rank whose key did not change between the
    readings (taken at least two beats apart) posted nothing in between, and went silent."""
    signs = []
    for rank, beat in after.items():
        if beat is None:
            signs.append(SignOfLife(rank, None, "unknown", silent=True))
            continue
        stamp, _, last = beat.partition(" ")
        signs.append(SignOfLife(rank, max(0.0, time.time() - float(stamp)), last, silent=beat == before.get(rank)))
    return signs


def headline(signs: list[SignOfLife]) -> str:
    """The clause that opens a failure's first line: the ranks that went silent first, then those alive but absent."""
    silent = [sign for sign in signs if sign.silent]
    absent = [sign for sign in signs if not sign.silent]
    parts = [sign.describe() for sign in silent] + [sign.describe() + ", stalled outside zerokit's collectives"
                                                    for sign in absent]
    return "; ".join(parts)


__all__ = ["HEARTBEAT_SECONDS", "Heartbeat", "SignOfLife", "default_store", "headline", "read_beats", "signs_of_life"]
