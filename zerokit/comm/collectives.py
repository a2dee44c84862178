"""The only place tensors cross ranks. Every collective is counted, by kind, in calls and bytes, recorded with
what it is for (flight.py), and waited on with a deadline (deadline.py).

Counting convention (shared with the planner): `elements`/`bytes` are the size of the whole logical
tensor of a call: the tensor for all-reduce and broadcast, the (full) input for reduce-scatter, the
(full) output for all-gather. What one rank actually sends on a ring is then
all-reduce 2(N-1)/N x bytes, reduce-scatter and all-gather (N-1)/N x bytes; `wire_bytes()` applies that.

[Note: bytes that cross nodes]
`comm_stats()["cross_node"]["bytes"]` is what this rank sends to ranks on other nodes, under the ring
convention above: a collective over a group of n ranks runs as one ring in the group's rank order (ascending
global ranks), in which every rank sends all of its ring traffic (the RING_FACTOR share of the logical bytes)
to the next rank of the group, the last to the first. Those bytes cross nodes exactly when that next rank is on
another node (nodes hold consecutive ranks: node = global rank // ranks per node). So a flat group over two nodes
of two ranks (0 1 | 2 3) sends across from ranks 1 and 3, each a whole ring share, and nothing from ranks 0 and
2; a MiCS replica group {0, 2} sends its whole share across from both. A group inside one node never counts.
The split by group ("<group>.<kind>" entries: "shard" and "gather" are the groups over every rank, "mics_shard",
"mics_gather", "mics_replica" MiCS's and "hpz_gather" hpZ's) and "cross_node" appear once a job spans more than
one node; collectives before the stage made its groups (the start-up checks, placing the model) are not counted
across.

The counting itself is counting.py's (CommStats for an engine, GroupCount for each of its groups); the groups'
ranks and whether a ring crosses nodes are config/settings.py's (consecutive_groups, strided_groups,
ring_crosses_nodes), which the planner calls too.

[Note: all-gather on gloo]
gloo's all-gather copies its result through a temporary as large as the output: with 25 MiB buckets
that was most of what stage 1 held beyond torch's ZeroRedundancyOptimizer at its peak (365 vs 277 MiB
of RSS in benchmarks/). There, each rank's slice of the output is broadcast in place from its owner
instead: N broadcasts of 1/N each, in which every rank sends its own slice to the N-1 others, the same
(N-1)/N of the output that a ring all-gather sends, so it is counted as the all-gather it is.

[Note: groups made beside the siblings']
torch's new_group is a collective over the whole job: every rank calls it, in the same order, with the same ranks,
and the group is named by how many groups came before it. An engine over one data group of a layout (the replicas
of one pipeline stage: See zerokit/parallel/mesh.py) makes more groups as it builds (stage 3's gather twin, MiCS's
splits, a gloo control group beside NCCL); if only its own ranks made them, the engines of the other stages would
make theirs under the same names over other ranks, and the two would meet in the store and hang. So a
Communicator knows its `siblings`, the global ranks of every group of its dimension, and each group it makes is
made over the same positions of every sibling, on every rank, in one order: the engines of all stages, built
together, make the same calls. An NCCL Communicator of a layout makes its gloo control group at once, not on first
use, since the stages' engines first use it at different times.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Iterable, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from zerokit.comm.counting import Collective, CommStats, GroupCount
from zerokit.comm.deadline import TrackedWork, Watcher
from zerokit.comm.flight import FlightRecorder
from zerokit.comm.liveness import Heartbeat, default_store

# torch 2.13 renamed the one-tensor collectives (its old names warn); torch before 2.13 has only the old ones
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending(NamedTuple):
    """An asynchronous collective: wait on `work`, then `output` holds the result."""

    output: torch.Tensor
    work: TrackedWork | None


class Communicator:
    """Collectives over one process group, counted, recorded and waited on with a deadline. A rename in torch
    touches only this class. See [Note: deadlines on collectives] in deadline.py and [Note: the flight recorder]
    in flight.py."""

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None, *,
                 name: str = "shard", timeout_seconds: float | None = None, recorder: FlightRecorder | None = None,
                 incident: str | None = None, owns_group: bool = False, siblings: list[list[int]] | None = None
                 ) -> None:
        """Pass the `stats` of another Communicator to count two process groups as one. `timeout_seconds`: every
        wait's deadline (None: wait as long as the group does). `name` labels this group in reports. `owns_group`:
        zerokit made `group` for this Communicator, and `close` destroys it. `siblings`: the global ranks of every
        group of this one's layout dimension, this one's included (See [Note: groups made beside the siblings'])."""
        self.group, self.owns_group = group, owns_group
        self.siblings = siblings or [dist.get_process_group_ranks(group or dist.group.WORLD)]
        self.closed = False  # See `close`
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)  # "nccl", "gloo", ...
        # where this group's tensors must be: NCCL reduces device tensors only
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self.stats = stats or CommStats(self.world_size)
        self.count = GroupCount(self.stats, name, self.rank, self.world_size)
        self.name, self.timeout_seconds = name, timeout_seconds
        self.blocking_waits = self.backend == "gloo"  # a gloo wait blocks the CPU anyway: give it the deadline
        self.incident = incident or _group_name(group)  # where this job's failure reports meet in the store
        self.recorder = recorder or FlightRecorder(self.rank, self.incident)
        self.sequence = 0  # collectives issued on this group so far
        self._control: Communicator | None = None
        self._watcher, self._heartbeat = _threads(self, owns_recorder=recorder is None)

    @classmethod
    def create(cls, timeout_seconds: float, stats: CommStats | None = None,
               parts: list[list[int]] | None = None, name: str = "shard") -> "Communicator":
        """The engine's: a new group over every rank (or over this rank's of `parts`, a layout's dimension: See
        zerokit/parallel/mesh.py) whose own timeout is the deadline (See [Note: deadlines on collectives]); the job's
        default group is left as the application set it. `name`: its label in reports."""
        backend = dist.get_backend()
        if backend == "fake":  # torch's fake back-end (shard arithmetic at sizes CI cannot spawn): nothing waits
            return cls(None, stats)
        siblings = parts or [list(range(dist.get_world_size()))]
        mine = new_group_beside(siblings, range(len(siblings[0])), backend, timeout_seconds)
        made = cls(mine, stats, name=name, timeout_seconds=timeout_seconds, owns_group=True, siblings=parts)
        if parts and backend != "gloo":
            made.control  # made now, while every sibling is here: See [Note: groups made beside the siblings']
        return made

    def split(self, parts: list[list[int]], name: str, twin_of: "Communicator | None" = None) -> "Communicator":
        """A Communicator over the part of `parts` (lists of this group's ranks, together every rank once) that
        holds this rank, counted in these stats under `name`; each part's control group (See `control`) is made here
        too, where it needs a group of its own, as every rank makes every group in one order. `twin_of`: an earlier
        split of the same parts, whose control group this one shares, as `twin` does."""
        own_control = twin_of is None and self.backend not in ("gloo", "fake")
        siblings = [[ranks[rank] for rank in part] for ranks in self.siblings for part in parts]  # every part's
        mine = None
        for part in parts:
            group = new_group_beside(self.siblings, part, self.backend, self.timeout_seconds)
            control = (new_group_beside(self.siblings, part, "gloo", self.timeout_seconds, "gloo")
                       if own_control else None)
            if self.rank in part:
                mine = self._member(group, self.stats, name, siblings=siblings)
                if control is not None:
                    mine._control = self._member(control, CommStats(len(part)), "control", siblings=siblings)
        if mine is None:
            raise RuntimeError(f"rank {self.rank} is in none of the groups {parts} (an internal bug)")
        if twin_of is not None and twin_of._control is not None and twin_of._control.group is not twin_of.group:
            mine._control = twin_of._control
        return mine

    def twin(self, name: str = "gather") -> "Communicator":
        """A Communicator over a new group with the same ranks, counted in the same stats: two streams of collectives
        (parameter gathers from module hooks, gradient reductions from grad hooks) may then interleave differently on
        different ranks without pairing the wrong calls. It shares this one's control group (See `control`)."""
        twin = self._sibling(name, backend=None, stats=self.stats)
        if self._control is not None and self._control.group is not self.group:
            twin._control = self._control
        return twin

    @property
    def control(self) -> "Communicator":
        """For small agreements (the start-up fingerprint, stage 3's unit agreement): CPU tensors whatever the
        back-end, so that they never wait on a GPU stream, counted apart from the model's traffic (in their own
        CommStats, not in comm_stats()) and numbered apart in reports. On gloo they go on this very group, in
        the order this group's other collectives are issued; on another back-end on a gloo group over the same
        ranks, made on first use (every rank must first use it at the same point)."""
        if self._control is None:
            cpu = self.backend in ("gloo", "fake")
            group = self.group if cpu else self._sibling("control", backend="gloo", stats=self.stats).group
            self._control = self._member(group, CommStats(self.world_size), "control", owns_group=False)
        return self._control

    def _sibling(self, name: str, backend: str | None, stats: CommStats) -> "Communicator":
        """A Communicator over a new group with the same ranks (`backend` None: this one's)."""
        group = new_group_beside(self.siblings, range(self.world_size), backend or self.backend, self.timeout_seconds,
                                 backend)
        return self._member(group, stats, name, siblings=self.siblings)

    def _member(self, group: dist.ProcessGroup | None, stats: CommStats, name: str,
                owns_group: bool = True, siblings: list[list[int]] | None = None) -> "Communicator":
        """A Communicator over `group` made for this one's engine: the same deadline, and failures reported with this
        one's (the same flight recorder and incident)."""
        return Communicator(group, stats, name=name, timeout_seconds=self.timeout_seconds, recorder=self.recorder,
                            incident=self.incident, owns_group=owns_group, siblings=siblings)

    def close(self) -> None:
        """Destroy the process group zerokit made for this Communicator (and its control group, when that is a
        group of its own), and let go of it, so that gloo's threads for it are joined now, while the interpreter
        can still give them the GIL (See [Note: leaving at exit] in zerokit/comm/process.py). Idempotent; a collective
        after it raises."""
        if self.closed:
            return
        self.closed = True
        for thread in (self._watcher, self._heartbeat):
            if thread is not None:
                thread.stop()
        if self._control is not None and self._control is not self:
            self._control.close()  # on gloo it shares this group: then it is only marked closed
        group, self.group = self.group, None
        if self.owns_group and group is not None:
            _destroy_group(group)

    # --- collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.AVG,
                   async_op: bool = False, purpose: str = "") -> Pending:
        """In place; AVG by default, which is what data-parallel gradients need. `purpose`, here and in every
        collective: what it is for, named in reports ("gradients: bucket 3 of param group 0")."""
        return self._launch(Collective.ALL_REDUCE, tensor, purpose, async_op,
                            lambda: [dist.all_reduce(tensor, op=op, group=self.group, async_op=True)])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       op: dist.ReduceOp = dist.ReduceOp.AVG, async_op: bool = False, purpose: str = "") -> Pending:
        """`output` (1D, numel/N) receives this rank's slice of the reduced `input` (1D).

        `output` must not alias `input`: gloo returns wrong values for the in-place form.
        """
        self._check_sizes("reduce_scatter", big=input, small=output)
        return self._launch(Collective.REDUCE_SCATTER, input, purpose, async_op,
                            lambda: [reduce_scatter_single(output, input, op=op, group=self.group, async_op=True)],
                            output)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   purpose: str = "") -> Pending:
        """`output` (1D) becomes the concatenation of every rank's `input` (1D, numel/N).

        `input` may be this rank's own slice of `output` (the in-place form).
        See [Note: all-gather on gloo].
        """
        self._check_sizes("all_gather", big=output, small=input)
        if self.backend != "gloo":
            return self._launch(Collective.ALL_GATHER, output, purpose, async_op,
                                lambda: [all_gather_single(output, input, group=self.group, async_op=True)])
        slots = output.chunk(self.world_size)

        def broadcast_slots() -> list[dist.Work]:
            if slots[self.rank].data_ptr() != input.data_ptr():
                slots[self.rank].copy_(input)
            return [dist.broadcast(slot, src=self._global(rank), group=self.group, async_op=True)
                    for rank, slot in enumerate(slots)]
        return self._launch(Collective.ALL_GATHER, output, purpose, async_op, broadcast_slots)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False, purpose: str = "") -> Pending:
        """In place: every rank's `tensor` becomes `src`'s."""
        return self._launch(Collective.BROADCAST, tensor, purpose, async_op,
                            lambda: [dist.broadcast(tensor, src=self._global(src), group=self.group, async_op=True)])

    def reduce(self, tensor: torch.Tensor, dst: int, op: dist.ReduceOp = dist.ReduceOp.AVG,
               async_op: bool = False, purpose: str = "") -> Pending:
        """In place on `dst`, which receives the reduction (AVG by default); the others' `tensor` is scratch."""
        return self._launch(Collective.REDUCE, tensor, purpose, async_op, lambda: [dist.reduce(
            tensor, dst=self._global(dst), op=op, group=self.group, async_op=True)])

    def _launch(self, kind: Collective, tensor: torch.Tensor, purpose: str, async_op: bool,
                issue: Callable[[], list[dist.Work]], output: torch.Tensor | None = None) -> Pending:
        """What every collective does around torch's call (`issue`): refuse on a closed group (None would mean the
        default group to torch), count `tensor` (the logical one), issue under the profiler's name for the kind,
        record it for reports, and wait on it now (its deadline applies) unless `async_op`."""
        if self.closed:
            raise RuntimeError(f"rank {self.rank}: a {kind.value} on zerokit's {self.name!r} group after its engine "
                               "was closed (engine.close() or destroy()); build a new engine to train again")
        self.count.record(kind, tensor, self.group)
        with record_function(f"zerokit::{kind.value}"):
            works = issue()
        self.sequence += 1
        entry = self.recorder.begin(self.name, self.sequence, kind.value, tensor.numel(),
                                    tensor.numel() * tensor.element_size(), purpose)
        work = TrackedWork(works, entry, self)
        if self._watcher is not None:
            self._watcher.watch(work)
        if not async_op:
            work.wait()
        return Pending(tensor if output is None else output, work if async_op else None)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group else rank

    def _check_sizes(self, name: str, big: torch.Tensor, small: torch.Tensor) -> None:
        if big.numel() != small.numel() * self.world_size:
            raise RuntimeError(f"rank {self.rank}: {name} needs {self.world_size} x {small.numel()} elements, "
                               f"got {big.numel()} (an internal sharding bug)")


def new_group_beside(siblings: list[list[int]], part: Iterable[int], backend: str, timeout_seconds: float | None,
                     new_backend: str | None = None) -> dist.ProcessGroup:
    """A new process group over the positions `part` of the sibling group holding this rank, whose own timeout is the
    deadline, and its likes over the same positions of every other sibling (See [Note: groups made beside the
    siblings']); this rank's, or torch's mark of a group it is not in. Every rank of the job must call it, in the same
    order: torch's new_group is a collective over the whole job. `new_backend`: the groups' (None: the job's)."""
    timeout = {"timeout": _group_timeout(timeout_seconds, backend)} if timeout_seconds else {}
    me, mine, part = dist.get_rank(), None, list(part)
    for ranks in siblings:
        group = dist.new_group([ranks[rank] for rank in part], backend=new_backend, **timeout)
        if me in ranks:
            mine = group
    return mine


def _group_timeout(timeout_seconds: float, backend: str) -> timedelta:
    """gloo: the deadline itself; NCCL: a margin more, so that zerokit's report comes before the watchdog's abort.
    See [Note: deadlines on collectives] in deadline.py."""
    return timedelta(seconds=timeout_seconds if backend == "gloo"
                     else timeout_seconds + max(10.0, timeout_seconds / 10))


def _threads(comm: Communicator, owns_recorder: bool) -> tuple[Watcher | None, Heartbeat | None]:
    """A Communicator's helper threads, where it has a deadline: the Watcher where its waits do not block the CPU
    (See [Note: deadlines on collectives] in deadline.py); the engine's sign of life, with its first Communicator
    (the one that made its recorder), where the job has a store (See [Note: naming the rank that went silent] in
    liveness.py)."""
    if not comm.timeout_seconds:
        return None, None
    watcher = None if comm.blocking_waits else Watcher(comm, min(1.0, comm.timeout_seconds / 4))
    store = default_store() if owns_recorder else None
    return watcher, None if store is None else Heartbeat(store, comm.recorder, comm.incident)


def _destroy_group(group: dist.ProcessGroup) -> None:
    """torch's record of `group` goes, unless the application's destroy_process_group() took every group's already;
    the group itself (and its threads) goes with the last reference, which the caller drops."""
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": no longer one torch knows
        pass


def _group_name(group: dist.ProcessGroup | None) -> str:
    try:
        return str((group or dist.group.WORLD).group_name)
    except (AttributeError, RuntimeError):
        return "world"


def wait(pending: Pending) -> torch.Tensor:
    if pending.work is not None:
        pending.work.wait()
    return pending.output
