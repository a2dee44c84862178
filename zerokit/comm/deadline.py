"""Bounded waits: every collective a Communicator issues is waited on with a deadline, and a collective that
does not complete in time, or fails because a peer did, raises one CollectiveError that names it.

[Note: deadlines on collectives]
A job on many ranks fails in ways one process never does, and the worst is a hang: a rank that stalls, or
that issues other collectives than its peers, leaves the others waiting until torch's process-group timeout
(30 minutes by default), with no word of why. So zerokit's process groups carry `comm_timeout_seconds`
(default 300 s) and every wait on a collective has that deadline, counted from the moment it is waited on:
  - gloo (CPU): `Work.wait(timeout)` blocks the CPU anyway, so it is given the time left. The group's own
    timeout is the same, so the collective running in gloo's background thread also gives up, and the
    process can shut down instead of hanging in destroy_process_group.
  - NCCL: a wait only makes the current CUDA stream wait, and blocking the CPU on every wait would stall
    the GPU pipeline. The group's timeout (comm_timeout_seconds plus a margin) lets NCCL's watchdog abort
    the collective; a watcher thread (Watcher) writes zerokit's report first, when the deadline passes.
On expiry, or when gloo reports that a peer closed its connection, the error names the collective (kind,
sequence number on its group, purpose), says how long this rank waited, lists the last collectives this
rank completed (See [Note: the flight recorder] in flight.py), names the file the whole ring was written
to, and says where every other rank stood: each failing rank posts a one-line summary to the job's
key-value store (the one torch.distributed rendezvoused through) and reads the others' for a short grace
period. A rank that posts nothing within it is named in the error's first line: gone silent (dead or frozen)
or alive and stalled outside zerokit's collectives, from its last sign of life, with the last collective it
completed (See [Note: naming the rank that went silent] in liveness.py).

[Note: a waited collective lets go of its tensors]
A torch work object holds its collective's tensors (NCCL's: its outputs, until the work object itself goes). The
Watcher keeps every NCCL collective until its thread next finds it completed, once a second: so it kept each one's
tensors for up to a second after zerokit was done with them. On an H200, once a step of a 337M-parameter model took
0.155 s, zerokit's stage-0 step peaked 5.4 GB above torch's own, about four steps' fp32 gradient buckets
(benchmarks/bench_gpu.py; not measured again since this change). So once waited on, a TrackedWork lets go of
torch's works; where the wait did not block the CPU it keeps instead an event recorded on the current stream, which
the device reaches only once the collective is done (the wait made the stream wait for it): the Watcher reads
completion from that.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from zerokit._support.log import logger
from zerokit.comm.flight import FlightEntry, FlightRecorder
from zerokit.comm.liveness import SignOfLife, default_store, headline, read_beats, signs_of_life

COMPLETED_IN_REPORT = 6  # last completed collectives quoted in an error
REPORT_POLL_SECONDS = 0.05


class Communicator(Protocol):
    """What a deadline reads of the Communicator (collectives.py) whose collectives it waits on."""

    rank: int
    world_size: int
    timeout_seconds: float | None
    blocking_waits: bool
    incident: str
    recorder: FlightRecorder


class CollectiveError(RuntimeError):
    """A collective zerokit issued did not complete in time, or failed because a peer did."""


def report_grace(timeout: float, timed_out: bool) -> float:
    """How long a failing rank waits for the other ranks' summaries. Ranks that time out on one collective do so
    within about the time they started waiting apart, so a quarter of the timeout (1-5 s); a peer's crash reaches
    every rank at once, so 1 s (a dead rank is noticed within seconds: keep it so)."""
    return min(5.0, max(1.0, timeout / 4)) if timed_out else 1.0


class TrackedWork:
    """The work of one issued collective (several torch works for gloo's all-gather; See [Note: all-gather on
    gloo] in collectives.py), its flight-recorder entry, and the Communicator whose deadline it keeps."""

    def __init__(self, works: Sequence[dist.Work], entry: FlightEntry, owner: Communicator) -> None:
        self.works = list(works)
        self.entry = entry
        self.owner = owner
        self.done = False
        self.reached: torch.cuda.Event | None = None  # after the wait: where the stream passes the collective

    def is_completed(self) -> bool:
        if self.reached is not None:
            return self.reached.query()
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        """Return once the collective completed; raise CollectiveError at its deadline or on a peer's failure."""
        if self.done:
            return
        timeout, started = self.owner.timeout_seconds, time.time()
        try:
            if timeout is None or not self.owner.blocking_waits:
                for work in self.works:
                    work.wait()
            else:
                for work in self.works:
                    left = started + timeout - time.time()
                    if left > 0:
                        work.wait(timedelta(seconds=left))
                    elif not work.is_completed():
                        raise TimeoutError("deadline passed")
        except Exception as error:  # gloo raises RuntimeError and DistBackendError alike
            raise failure(self.owner, self.entry, error, time.time() - started) from error
        self.done = True
        if self.owner.blocking_waits or self.is_completed():
            self.entry.end = time.time()
        elif torch.cuda.is_available():
            reached = torch.cuda.Event()
            reached.record()
            self.reached = reached  # recorded before the Watcher thread can read it
        else:  # another device's non-blocking back-end: keep the works to tell completion
            return
        self.works = []  # See [Note: a waited collective lets go of its tensors]


def failure(comm: Communicator, entry: FlightEntry, error: BaseException, waited: float) -> CollectiveError:
    """The error every failing rank raises: first one line naming the ranks that went silent and where they stood
    (See [Note: naming the rank that went silent] in liveness.py), then what this rank waited on and for how long,
    what it completed last, where the other ranks stood, and the file its flight recorder went to. See [Note:
    deadlines on collectives]."""
    timeout = comm.timeout_seconds or 0.0
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    timed_out = bool(timeout) and (time.time() - entry.start >= 0.99 * timeout or "timed out" in cause.lower()
                                   or isinstance(error, TimeoutError))
    if timed_out:
        what = f"did not complete within comm_timeout_seconds={timeout:g} (waited {waited:.1f} s)"
    else:
        what = f"failed after {waited:.1f} s: {cause}"
    entry.error = "timed out" if timed_out else cause
    completed = comm.recorder.last_completed(COMPLETED_IN_REPORT)
    summary = f"{entry.name()} {what}; last completed: {completed[-1].name() if completed else 'none'}"
    path = comm.recorder.dump(f"rank {comm.rank}: {summary}")
    stood, absent = exchange_reports(comm, summary, report_grace(timeout, timed_out))
    now = time.time()
    lines = [first_line(comm.rank, entry, what, absent),
             f"  last collectives rank {comm.rank} completed (oldest first):",
             *[f"    {done.line(now)}" for done in completed or []], *([] if completed else ["    none"]),
             "  where each rank stood:", *[f"    {line}" for line in stood],
             f"  flight recorder of rank {comm.rank} (its last {len(comm.recorder.entries)} collectives): "
             f"{path if path is not None else 'not written (no writable directory)'}"]
    return CollectiveError("\n".join(lines))


def first_line(rank: int, entry: FlightEntry, what: str, absent: list[SignOfLife]) -> str:
    """`rank 0: rank 1 went silent 1.2 s ago, after <its last collective>; here <this one> failed ...`: the line a
    launcher's log shows. Without a silent rank to name: what this rank waited on, and the possible causes."""
    here = f"{entry.name()}, {entry.numel:,} elements, {what}"
    if absent:
        return f"rank {rank}: {headline(absent)}; here {here}"
    return (f"rank {rank}: {here}. A rank stalled, died, or issued other collectives than this one (see where each "
            "rank stood, below).")


def exchange_reports(comm: Communicator, summary: str, grace: float) -> tuple[list[str], list[SignOfLife]]:
    """Post this rank's summary to the job's store and collect the others' for up to `grace` seconds. Returns a line
    per rank, and the last sign of life of each rank that sent no report."""
    store = default_store()
    if store is None:
        return [f"rank {comm.rank}: {summary}", "(other ranks: no key-value store to exchange reports through)"], []
    prefix = f"zerokit/failure/{comm.incident}/"
    try:
        store.set(prefix + str(comm.rank), summary)
        beats = read_beats(store, comm.incident, [rank for rank in range(comm.world_size) if rank != comm.rank])
        reports: dict[int, str] = {}
        give_up = time.time() + grace
        while len(reports) < comm.world_size and time.time() < give_up:
            for rank in range(comm.world_size):
                if rank not in reports and store.check([prefix + str(rank)]):
                    reports[rank] = store.get(prefix + str(rank)).decode()
            time.sleep(0 if len(reports) == comm.world_size else REPORT_POLL_SECONDS)
        absent = signs_of_life(beats, read_beats(store, comm.incident,
                                                 [rank for rank in range(comm.world_size) if rank not in reports]))
    except Exception as error:  # the store lives on a rank that may be the one that died
        return [f"rank {comm.rank}: {summary}", f"(other ranks: the key-value store failed: {error})"], []
    silent = (f"no report within {grace:.1f} s: stalled outside zerokit's collectives, blocked in other "
              "code, or dead")
    signs = {sign.rank: sign for sign in absent}
    return [f"rank {rank}: {reports[rank]}" if rank in reports else f"rank {rank}: {silent} ({signs[rank].describe()})"
            for rank in range(comm.world_size)], absent


class Watcher:
    """For back-ends whose waits do not block the CPU (NCCL): a daemon thread that notices a collective past
    its deadline and writes the report before the back-end's watchdog aborts the process. One per recorder."""

    def __init__(self, comm: Communicator, period: float) -> None:
        self.comm, self.period = comm, period
        self.works: list[TrackedWork] = []
        self.lock = threading.Lock()
        self.reported = False
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="zerokit-deadline-watcher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the thread (its Communicator is closed) and wait for it."""
        self.stopping.set()
        self.thread.join()

    def watch(self, work: TrackedWork) -> None:
        with self.lock:
            self.works.append(work)

    def check(self, now: float) -> CollectiveError | None:
        """Drop completed works; the error for the oldest one past its deadline (once), else None."""
        timeout = self.comm.timeout_seconds or 0.0
        with self.lock:
            for work in [w for w in self.works if w.is_completed()]:
                work.entry.end = work.entry.end or now
                self.works.remove(work)
            late = next((w for w in self.works if now - w.entry.start > timeout), None)
        if late is None or self.reported:
            return None
        self.reported = True
        return failure(self.comm, late.entry, TimeoutError("deadline passed"), now - late.entry.start)

    def _run(self) -> None:
        while not self.stopping.wait(self.period):
            error = self.check(time.time())
            if error is not None:
                logger.error(str(error))
