"""The data position an engine saves in its checkpoints: the state of the loader or sampler it tracks (See [Note:
the data position] in zerokit/checkpoint/sampling.py), one per rank, in the checkpoint's `data_position.pt`.

[Note: a position loaded before its loader exists]
A resume at start-up (the config's `resume` block) loads the checkpoint inside initialize, before the script has
made its loader: the drop-in's initialize makes its loader after the engine, and a zerokit script makes its sampler
once initialize has started the process group. So a loaded position waits in the engine until a loader is
tracked, and goes into it then; a loader tracked before the load gets it at once. A checkpoint saved before zerokit
saved positions (or by a run that tracked none) has none: one line says so, and the loader starts where the
script starts it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerokit._support.log import logger

DATA_POSITION = "data_position.pt"  # {rank: the tracked source's state_dict()}, pickled by rank 0


class DataPosition:
    """What one engine tracks: a loader or sampler with state_dict() and load_state_dict() (zerokit's
    ResumableLoader or ResumableSampler, torchdata's StatefulDataLoader), and a loaded state not yet given to one."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.source: Any = None
        self.waiting: dict[str, Any] | None = None  # See [Note: a position loaded before its loader exists]

    def track(self, source: Any) -> Any:
        """From now on `source`'s state is saved in every checkpoint of the engine and restored at every load; a
        position loaded before (a resume at start-up) goes into it now. Returns `source`."""
        if not (callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))):
            raise ValueError(f"engine.data_position.track({type(source).__name__}): it needs state_dict() and "
                             "load_state_dict(); use zerokit.checkpoint.sampling.ResumableSampler or ResumableLoader")
        self.source = source
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            source.load_state_dict(waiting)
        return source

    @property
    def tracked(self) -> bool:
        return self.source is not None

    def state(self) -> dict[str, Any] | None:
        """This rank's position to save; None when nothing is tracked, or when the source fails to say (then in a
        warning: every rank must still reach the save's collectives)."""
        if self.source is None:
            return None
        try:
            return self.source.state_dict()
        except Exception as error:  # a source of the user's: any type
            logger.warning(f"rank {self.rank}: the data position of {type(self.source).__name__} was not saved: "
                           f"state_dict() raised {type(error).__name__}: {error}")
            return None

    def restore(self, saved: dict[int, dict[str, Any]] | None, where: Path) -> None:
        """This rank's saved position (rank 0's for a rank the saving run did not have) into the tracked source, or
        kept for the one tracked later (See [Note: a position loaded before its loader exists])."""
        if saved is None:
            if self.rank == 0:
                logger.info(f"{where}: the data position was not in the checkpoint (saved before zerokit kept it, "
                            "or with no loader tracked): the loader starts where the script starts it")
            return
        state = saved.get(self.rank, saved.get(0))
        if self.source is None:
            self.waiting = state
        else:
            self.source.load_state_dict(state)


__all__ = ["DATA_POSITION", "DataPosition"]
