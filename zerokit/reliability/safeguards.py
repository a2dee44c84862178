"""What the engine calls: the checks at initialize, in one order, and the guards of the training loop."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from zerokit.comm import Communicator
from zerokit.reliability.forward_only import ForwardOnlyGuard
from zerokit.reliability.buffers import BufferSync
from zerokit.reliability.compiled import refuse_fullgraph_around_units
from zerokit.reliability.fingerprint import check_ranks_agree, fingerprint
from zerokit.reliability.mistakes import (TrainableGuard, check_backward_order, refuse_misnumbered_node,
                                          refuse_nothing_to_train, refuse_wrapped)
from zerokit.config.settings import SafeguardSettings


def check_at_start(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], part: SafeguardSettings,
                   comm: Communicator, device: torch.device) -> None:
    """Before the engine's first collective on the model: this rank's own checks (a wrapped model, nothing to
    train), then the start-up fingerprint (See [Note: the start-up fingerprint] in fingerprint.py). A rank's own
    problem goes into its fingerprint first, so that a problem on some ranks only is named on every rank at
    once instead of leaving the others waiting for it."""
    problem: ValueError | None = None
    try:
        refuse_wrapped(model)
        if optimizers:  # none: an engine that runs forward only (See zerokit/reliability/forward_only.py)
            refuse_nothing_to_train(model)
        refuse_fullgraph_around_units(model, part.stage, part.units)
        refuse_misnumbered_node(part.ranks_per_node, part.node_rank, comm.rank)
    except ValueError as error:
        problem = error
    fields = {"start-up checks": str(problem) if problem else "passed",
              "ranks per node": str(part.ranks_per_node)}
    if problem is None:
        fields.update(fingerprint(model, optimizers, part.agreed, part.stage, part.units, device))
    try:
        check_ranks_agree(fields, comm.control)
    finally:
        if problem is not None:  # this rank's own problem, whether or not the others share it
            raise problem


class Safeguards:
    """The training loop's guards: requires_grad as at start, backward/step order, buffers kept equal; with
    forward_only (no optimizer), no training at all (See zerokit/reliability/forward_only.py)."""

    def __init__(self, model: nn.Module, comm: Communicator, part: SafeguardSettings,
                 forward_only: bool = False) -> None:
        self.trainable = TrainableGuard(model)
        self.buffers = BufferSync(model, comm, part.broadcast_buffers)
        self.accumulation = part.gradient_accumulation_steps
        self.forward_only = ForwardOnlyGuard(model, comm.rank, part.has_scheduler) if forward_only else None

    def before_backward(self, backward_since_step: bool, window_ended: bool) -> None:
        if self.forward_only is not None:
            self.forward_only.refuse("backward")
        check_backward_order(backward_since_step, window_ended, self.accumulation)
        self.trainable.check()

    def before_step(self) -> None:
        if self.forward_only is not None:
            self.forward_only.refuse("step")

    def at_step(self) -> None:
        self.buffers.sync()

    def close(self) -> None:
        """Take the buffer sync's hooks off the model (and a forward-only engine's gradient hooks)."""
        self.buffers.close()
        if self.forward_only is not None:
            self.forward_only.close()
