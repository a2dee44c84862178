"""A bucket's reduction in flight: one collective, or several in sequence, each started once the one
before it is done (a reduce-scatter in the shard group, then an all-reduce across replicas, say),
ending in a step that stores the result."""

from __future__ import annotations

from typing import Callable

import torch

from zerokit.comm.collectives import Pending, wait

Then = Callable[[torch.Tensor], "Reduction | None"]


class Reduction:
    def __init__(self, pending: Pending, then: Then | None = None, keep_alive: torch.Tensor | None = None) -> None:
        """Wait on `pending`, then call `then` with its output: it stores the result (returns None) or
        starts the next collective (returns its Reduction). `keep_alive` holds the collective's input
        until then."""
        self.pending = pending
        self.then = then
        self.keep_alive = keep_alive

    def complete(self) -> None:
        reduction: Reduction | None = self
        while reduction is not None:
            output = wait(reduction.pending)
            reduction = reduction.then(output) if reduction.then is not None else None
