"""Process group and device (the logger itself is _support/log.py's, the start-up log engine/startup.py's):
torchrun's environment, or one plain process; and what is left at exit.

[Note: leaving at exit]
Scripts end in two common ways: with dist.destroy_process_group() while the engine is still referenced (DeepSpeed's
and FSDP's examples), or with nothing at all. Either way a rank could be killed by SIGABRT ("terminate called
without an active exception") after training finished. Core dumps of such ranks show why (torch 2.13, gloo):
gloo's worker thread (pt_gloo_runloop) destroys a Work it holds the last reference to, the Work holds a Python
object, releasing it takes the GIL, and a thread that takes the GIL after the interpreter began to finalize is
ended (pthread_exit), whose unwinding meets the Work's noexcept destructor: std::terminate. A Work holds Python
objects through the thread-local state it copies when issued (inside a backward torch keeps a contextvars context
there: autograd/graph.py, _engine_run_backward), so every gradient reduction and stage-3 gather from a backward
hook does; and through its tensors, once Python has let go of them. The worker lets go of a Work just after
completing it, often after the rank's own thread dropped its handle; late, on a loaded machine. That race is
torch's: its DDP meets it too (2 of 40 runs here; its reducer keeps only each Work's future, so the worker always
lets go last). zerokit's share: its own groups (Communicator.create, the stage-3 twin, the checkpoint group) belong
to the engine, and destroy_process_group() removes only torch's record of them, so with the engine still
referenced they lived, with their gloo threads, into the interpreter's finalization.
The remedy is to join gloo's threads before the interpreter finalizes: a group's threads are joined when the group
itself goes (its destructor releases the GIL while it waits, so a worker can still let go of a Work). So at exit
(atexit runs before finalization) every engine still open is closed (Engine.close: its groups destroyed and let go
of), and then the default group destroyed if the script left it. tests/test_exit.py checks, at each of many real
exits, that no gloo thread is left when the interpreter finalizes. Without zerokit, torch alone: a collective still
in flight at exit aborted 17 of 40 two-rank runs, and 0 of 40 with an atexit hook that destroyed the group first.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import weakref
from typing import Protocol

import torch
import torch.distributed as dist

from zerokit._support.log import configure_logging, logger  # noqa: F401  (scripts import both from here too)
from zerokit.comm.rendezvous import init_job_group


def ensure_process_group() -> None:
    """Join the group torchrun describes (NCCL with CUDA, gloo on CPU), or make a 1-rank group of the
    same back-end so that a plain `python train.py` runs the same code path as a launched job. Either way the
    groups are left at exit if the script does not leave them (See `leave_process_groups_at_exit`)."""
    leave_process_groups_at_exit()
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one plain process on a GPU machine trains on its GPU too
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" in os.environ:
        init_job_group(backend)  # See [Note: a key space per attempt] in zerokit/comm/rendezvous.py
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class Closable(Protocol):
    def close(self) -> None: ...


_OPEN_ENGINES: "weakref.WeakKeyDictionary[Closable, int]" = weakref.WeakKeyDictionary()  # -> order of creation
_CREATED = itertools.count()


def close_at_exit(engine: Closable) -> None:
    """Close `engine` at interpreter exit if the script has not (See [Note: leaving at exit]). Held weakly: an
    engine the script let go of takes its groups with it when it is collected."""
    leave_process_groups_at_exit()
    _OPEN_ENGINES[engine] = next(_CREATED)


def open_engines() -> list[Closable]:
    """Engines made and not closed, oldest first."""
    return sorted(_OPEN_ENGINES.keys(), key=_OPEN_ENGINES.get)


def forget_at_exit(engine: Closable) -> None:
    """`engine` closed itself: nothing to do for it at exit."""
    _OPEN_ENGINES.pop(engine, None)


@functools.cache
def leave_process_groups_at_exit() -> None:
    """Register, once, what runs at interpreter exit: every engine still open is closed, newest first, and then
    the default group destroyed if the script did not (See [Note: leaving at exit])."""
    atexit.register(_leave_process_groups)


def _leave_process_groups() -> None:
    for engine in reversed(open_engines()):
        try:
            engine.close()
        except Exception as error:  # one engine's failure must not keep the others' groups alive
            logger.warning("closing an engine at exit failed: %s", str(error).splitlines()[0] if str(error) else
                           type(error).__name__)
    if dist.is_initialized():
        dist.destroy_process_group()


def default_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
