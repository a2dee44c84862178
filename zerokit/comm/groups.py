"""The process groups a stage communicates over, owned by the stage (not chosen by the engine)."""

from __future__ import annotations

from dataclasses import dataclass

from zerokit.comm.collectives import Communicator


@dataclass(frozen=True)
class ProcessGroups:
    shard: Communicator
    """The ranks that split the model states between them: gradient reductions, parameter all-gathers
    at stages 1-2, the global gradient norm."""
    gather: Communicator
    """Stage 3's parameter gathers (from forward and backward hooks): a twin of `shard`, so that they
    cannot pair with a gradient reduction issued in another order on another rank (See Communicator.twin).
    The same Communicator as `shard` at stages 0-2."""

    def close(self) -> None:
        """Destroy both groups (See Communicator.close)."""
        self.gather.close()
        self.shard.close()

    @classmethod
    def for_stage(cls, comm: Communicator, stage: int) -> "ProcessGroups":
        return cls(shard=comm, gather=comm.twin() if stage == 3 else comm)
