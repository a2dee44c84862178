"""Run a function on N real gloo ranks on this machine (127.0.0.1, file rendezvous) and collect
what each rank returns.

[Note: ranks forked from a server that has imported torch]
A rank started with torch's default "spawn" is a new interpreter that imports torch and zerokit first: about
2.2 s of CPU a rank on this machine, paid again by every spawn of a test suite that makes hundreds. Ranks are
forked instead from multiprocessing's fork server, which imports them once (`PRELOADED`) and stays up for the
life of the process that asked for it; a rank then starts in a few milliseconds with those modules in memory.
The server forks from a process that has run no torch operation, so no thread pool is copied half-made. What
the server does not share with the caller is fixed when it starts, except what multiprocessing sends with each
process (sys.path, the working directory, the main module); the caller's environment is sent with the
arguments and set in the rank before `fn` runs, as a spawned rank would have inherited it.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# [Note: a gloo mesh that does not connect]
# About once in some hundreds of spawns in the suite (never in 139 fresh 2-rank spawns making 6 groups each, three at
# a time, alone), gloo fails while connecting a new group's ranks: "Gloo connectFullMesh failed ... Connection closed
# by peer [127.0.0.1]:PORT", with the peer rank alive and waiting in the same call, and a PORT that no rank of the
# test listens on (2751, 18662, 35543 in three failures). It was seen only while the other suite worker was
# starting and killing launches of its own. A result is read only from an attempt whose every rank finished, so
# starting the ranks again cannot hide a wrong one: that failure alone is retried, once, and said on stderr.
MESH_FAILURE = "Gloo connectFullMesh failed"
MESH_RETRIES = 1

# Imported once by the fork server (See [Note: ranks forked from a server that has imported torch]); a module that
# is not installed is skipped by the server.
PRELOADED = ["torch", "torch.distributed", "zerokit.engine.engine", "zerokit.testing.parity", "transformers"]


def _worker(rank: int, fn: Callable[..., Any], world_size: int, workdir: str, args: tuple,
            environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(1)  # N ranks share 2 cores; more threads only thrash
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(workdir) / f"result_{rank}.pt")
    except BaseException:
        (Path(workdir) / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        # What `fn` left in reference cycles (an engine, its hooks and process groups) is collected now, while
        # the groups still exist: collected at interpreter exit instead, after destroy_process_group, a rank
        # aborted in about 1 of 40 stage-3 runs ("terminate called without an active exception"; 0 of 160 since)
        gc.collect()
        dist.destroy_process_group()  # gloo can abort at exit without it


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None,
          fresh: bool = False) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` processes; returns each rank's result, in rank order.
    `fn` must be a module-level function (it is pickled to the children). `timeout` (seconds): ranks still
    running after it are killed and this raises, so that a hung rank cannot hang a test run. `fresh`: each rank is a
    new interpreter (torch's "spawn"), for a test of what a whole process holds or does (its resident memory from
    /proc/self/status, its atexit handlers, which a forked rank does not run: it leaves by os._exit)."""
    for attempt in range(1 + MESH_RETRIES):
        with tempfile.TemporaryDirectory(prefix="zerokit-spawn-") as workdir:
            try:
                multiprocessing.set_forkserver_preload(PRELOADED)
                context = mp.start_processes(_worker, args=(fn, world_size, workdir, args, dict(os.environ)),
                                             nprocs=world_size, join=False,
                                             start_method="spawn" if fresh else "forkserver")
                _join(context, timeout)
            except Exception as error:
                failures = _failures(Path(workdir))
                if attempt < MESH_RETRIES and MESH_FAILURE in failures:
                    sys.stderr.write(f"zerokit.testing.spawn: gloo could not connect the ranks; started again once "
                                     f"(See [Note: a gloo mesh that does not connect]):\n{failures}\n")
                    continue
                raise RuntimeError(f"a rank failed:\n{failures}") from error
            return [torch.load(Path(workdir) / f"result_{rank}.pt", weights_only=False) for rank in range(world_size)]
    raise AssertionError("unreachable: the last attempt returns or raises")


def _failures(workdir: Path) -> str:
    """The failed ranks' last lines, the first to fail first (a rank that failed after a peer died reports the
    lost connection, not the cause), then the first failure's whole traceback."""
    errors = sorted(workdir.glob("error_*.txt"), key=lambda path: path.stat().st_mtime)
    texts = [(path.stem.removeprefix("error_"), path.read_text()) for path in errors]
    lines = [f"rank {rank}: {text.strip().splitlines()[-1]}" for rank, text in texts if text.strip()]
    return "\n".join(lines + [texts[0][1]]) if texts else ""


def _join(context: mp.ProcessContext, timeout: float | None) -> None:
    """Wait for every rank; a rank's failure raises (the others are terminated), as does the timeout."""
    give_up = None if timeout is None else time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if give_up is not None and time.monotonic() > give_up:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"the ranks were still running after {timeout:g} s and were killed")
