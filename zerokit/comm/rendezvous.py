"""The job's process group, started by zerokit where a script leaves that to it (zerokit.initialize, the drop-in's
deepspeed.init_distributed) in keys of its own for each torchrun attempt, so that a restart comes back.

[Note: a key space per attempt]
Under torchrun the elastic agent hosts the TCPStore its workers start their group in
(TORCHELASTIC_USE_AGENT_STORE=True) and keeps it across restarts (pytorch issue 135712). torch's env:// start
writes fixed keys there (each rank's gloo address, the start-up barrier), so a restarted rank that reads them
before its peers have written theirs again finds the previous attempt's: it connects to a process that is gone
("Gloo connectFullMesh failed ... Connection refused") or waits at a barrier the others passed; measured here,
a stage-2 job with rank 1 killed and coming back 3 s late failed at every restart. zerokit starts the group under
a prefix no earlier attempt wrote:
  - rank 0 publishes a fresh attempt id under one fixed key, waits for every other rank's hello under that id,
    then publishes the hellos' tokens as its welcome;
  - every other rank reads the id, says hello with a token of its own process, and waits for a welcome that holds
    its token, reading the id again while it waits: an id left by the previous attempt's rank 0, which is dead,
    never welcomes it, and only the living rank 0 writes a new one;
  - every rank then starts the group in a PrefixStore under the id.
Ranks may come back in any order and at any time within the start-up timeout. A script that starts the group
itself keeps torch's keys, and so does every group made after it (zerokit's own too): `import zerokit`, in a
restarted attempt, warns which setting avoids the fault (zerokit/_support/torchrun.py).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from zerokit._support.torchrun import under_agent_store

ATTEMPT_KEY = "zerokit/attempt"
POLL_SECONDS = 0.1


def init_job_group(backend: str, timeout: timedelta | None = None) -> None:
    """torch.distributed's default group over the ranks torchrun describes, under the agent's store in keys of this
    attempt's own (See [Note: a key space per attempt]); torch's env:// start otherwise."""
    if not under_agent_store():
        dist.init_process_group(backend, **({"timeout": timeout} if timeout else {}))
        return
    timeout = timeout or dist.default_pg_timeout
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    attempt = _publish_attempt(store, world_size, timeout) if rank == 0 else _join_attempt(store, rank, timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"zerokit/{attempt}/group/", store), rank=rank,
                            world_size=world_size, timeout=timeout)


def _publish_attempt(store: dist.Store, world_size: int, timeout: timedelta) -> str:
    attempt = uuid.uuid4().hex
    store.set(ATTEMPT_KEY, attempt)
    hellos = [f"zerokit/{attempt}/hello/{rank}" for rank in range(1, world_size)]
    if hellos:
        store.wait(hellos, timeout)
    store.set(f"zerokit/{attempt}/welcome", ",".join(store.get(key).decode() for key in hellos))
    return attempt


def _join_attempt(store: dist.Store, rank: int, timeout: timedelta) -> str:
    token, answered = uuid.uuid4().hex, None
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        attempt = store.get(ATTEMPT_KEY).decode()  # waits for the first attempt's rank 0; then maybe a dead one's
        if attempt != answered:
            store.set(f"zerokit/{attempt}/hello/{rank}", token)
            answered = attempt
        welcome = f"zerokit/{attempt}/welcome"
        if store.check([welcome]) and token in store.get(welcome).decode().split(","):
            return attempt
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"rank {rank}: rank 0 did not start this attempt's process group within {timeout} (the "
                       f"last attempt id it read was {answered}); is rank 0 running?")


__all__ = ["init_job_group"]
