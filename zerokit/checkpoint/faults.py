"""A kill a test injects into a save, at a point no outside process can time (not for users).

[Note: a save killed on purpose]
tests/test_restart.py shows that a job whose ranks are killed in the middle of a save comes back from the previous
checkpoint. The kill must land inside zerokit's own save, so save_checkpoint reads ZEROKIT_KILL_DURING_SAVE once
per save and passes what it says down to the code that writes:
  - `rank-file`: every rank SIGKILLs itself once it has written the header and half the tensors of its rank file
    (the job killed while every rank writes);
  - `commit`: rank 0 SIGKILLs itself between moving an earlier checkpoint of the same tag aside and moving the new
    one in, the one moment at which `<save_dir>/<tag>` does not exist (See [Note: an atomic save] in save.py).
Unset, as it always is outside those tests, it costs one environment read per save. The test's job sets it in the
attempt it means to kill, just before the save it means to kill (tests/scripts/restart_job.py).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Callable

KILL_DURING_SAVE = "ZEROKIT_KILL_DURING_SAVE"
RANK_FILE, COMMIT = "rank-file", "commit"


@dataclass(frozen=True)
class SaveFault:
    """Where this save kills its process, if anywhere. See [Note: a save killed on purpose]."""

    point: str | None = None

    @classmethod
    def from_environment(cls) -> "SaveFault":
        point = os.environ.get(KILL_DURING_SAVE) or None
        if point not in (None, RANK_FILE, COMMIT):
            raise ValueError(f"{KILL_DURING_SAVE}={point!r} is not a point of a save; use {RANK_FILE} or {COMMIT} "
                             "(a setting for zerokit's own tests)")
        return cls(point)

    def at(self, point: str) -> None:
        if self.point == point:
            os.kill(os.getpid(), signal.SIGKILL)

    def half_way(self, tensors: int) -> Callable[[int], None] | None:
        """write_file's hook that kills this process once half of `tensors` are written (`rank-file` only)."""
        if self.point != RANK_FILE:
            return None
        return lambda written: self.at(RANK_FILE) if written >= max(tensors // 2, 1) else None


NO_FAULT = SaveFault()
