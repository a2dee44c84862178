"""What a checkpointing engine keeps between saves: a process group for the checkpoint's own small
messages, the background writer of asynchronous saves, and the host buffers they are copied into.

[Note: a process group of its own]
Saving needs a few collectives of small Python objects (the tag every rank agreed on, each rank's file
record for the manifest, whether any rank failed). They go over a gloo group created for checkpoints at
the first save or load (every rank calls those together), not over the training groups of zerokit/comm:
an asynchronous save commits from a background thread while training issues its own collectives from
the main thread, and two threads must never share a group, whose collectives are matched by issue
order. These are CPU objects, not model tensors, so they are not counted in `comm_stats()`.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from zerokit.checkpoint.checkpointed import Checkpointed
from zerokit.tiers.pinned import host_buffer

if TYPE_CHECKING:
    from zerokit.checkpoint.collect import SaveEntry


class CheckpointGroup:
    """The engine's ranks, over gloo, for small Python objects. See [Note: a process group of its own]."""

    def __init__(self, parts: list[list[int]] | None = None) -> None:
        """`parts`: the global ranks of the engine's group and of its siblings (an engine over one data group of a
        layout checkpoints with its data group: See [Note: groups made beside the siblings'] in comm/collectives.py);
        None: every rank. Every part's group is made on every rank, in order."""
        parts = parts or [list(range(dist.get_world_size()))]
        me, self.group = dist.get_rank(), None
        for part in parts:
            group = dist.new_group(part, backend="gloo") if len(part) > 1 else None
            if me in part:
                self.rank, self.world_size, self.group = part.index(me), len(part), group

    def close(self) -> None:
        """Destroy the group and let go of it (See [Note: leaving at exit] in zerokit/comm/process.py)."""
        group, self.group = self.group, None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except ValueError:  # the application's destroy_process_group() destroyed every group already
                pass

    def all_gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered


class AsyncWriter:
    """Runs one save at a time in a background thread; `wait` joins it and raises what it raised. A
    non-daemon thread: a script that ends while it writes waits for it at exit."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as error:  # handed to the training thread at the next wait
                self.error = error

        self.thread = threading.Thread(target=run, name="zerokit-checkpoint-writer")
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"the last asynchronous checkpoint save failed: {error}") from error

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class HostBuffers:
    """Host copies of one rank's checkpoint tensors, for asynchronous saves: training waits only for the
    copy, and the buffers are reused by the next save (the previous one has finished writing by then),
    so a save allocates nothing after the first. Pinned when the sources are on a GPU."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def stage(self, entries: list["SaveEntry"]) -> list["SaveEntry"]:
        from zerokit.checkpoint.collect import SaveEntry

        kept, staged, on_gpu = {}, [], False
        for entry in entries:
            spec = entry.spec
            buffer = self.buffers.get(spec.key)
            gpu = any(source.device.type == "cuda" for source in entry.sources)
            on_gpu |= gpu
            if buffer is None or buffer.numel() != spec.numel or buffer.dtype != spec.dtype:
                buffer = host_buffer(spec.numel, dtype=spec.dtype, pin=gpu)  # See zerokit/tiers/pinned.py
            offset = 0
            for source in entry.sources:
                buffer[offset:offset + source.numel()].copy_(source.reshape(-1), non_blocking=gpu)
                offset += source.numel()
            kept[spec.key] = buffer
            staged.append(SaveEntry(spec, [buffer]))
        if on_gpu:
            torch.cuda.synchronize()
        self.buffers = kept
        return staged

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


@dataclass
class Session:
    group: CheckpointGroup
    writer: AsyncWriter = field(default_factory=AsyncWriter)
    host: HostBuffers = field(default_factory=HostBuffers)


_SESSIONS: "weakref.WeakKeyDictionary[Checkpointed, Session]" = weakref.WeakKeyDictionary()


def session_of(engine: Checkpointed) -> Session:
    """The engine's checkpoint session, made at its first save or load (a collective: every rank calls it)."""
    if engine not in _SESSIONS:
        comm = getattr(engine, "comm", None)  # an engine's Communicator: its data group and the siblings'
        _SESSIONS[engine] = Session(CheckpointGroup(comm.siblings if comm is not None else None))
    return _SESSIONS[engine]


def wait(engine: Checkpointed) -> None:
    """Block until the engine's asynchronous save, if one is running, is on disk and committed (the
    `latest` pointer moved); raises what it failed with. Call it before destroying the process group."""
    if engine in _SESSIONS:
        _SESSIONS[engine].writer.wait()


def close(engine: Checkpointed) -> None:
    """End the engine's checkpoint session, if it has one: wait for its asynchronous save (raising what it failed
    with), then destroy its process group."""
    session = _SESSIONS.pop(engine, None)
    if session is not None:
        try:
            session.writer.wait()
        finally:
            session.group.close()
