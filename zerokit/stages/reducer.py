"""When gradient buckets are reduced: as soon as each is complete, in one fixed order on all ranks.

The state object here only tracks readiness and issues reductions; *what* a reduction does belongs
to the stage (`stage.reduce_bucket`). Parameters that will get no gradient in a step (an unused
branch, possibly on one rank only) are found before backward starts by walking the loss's autograd
graph, as torch DDP's find_unused_parameters does, and count as ready at once; otherwise one unused
parameter would hold back every later bucket. Whatever is still pending after backward is launched
by `flush()`, always in bucket order, so no rank waits for a collective another rank never issues.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from zerokit.comm import Reduction
from zerokit.flat import Bucket
from zerokit.stages.base import ZeroStage


class BucketReducer:
    def __init__(self, stage: ZeroStage) -> None:
        self.stage = stage
        self.buckets = stage.layout.buckets
        self.overlap = stage.part.overlaps_reduction
        self.max_in_flight = stage.reductions_in_flight  # bounds staging memory to this many full buckets
        self.bucket_of = {slot.param_index: bucket.index for bucket in self.buckets for slot in bucket.slots}
        self.index_of = {id(param): index for index, param in enumerate(stage.flat.params)}
        self.in_flight: deque[tuple[Bucket, Reduction]] = deque()
        self.armed = False
        self.final = False  # this backward ends the accumulation window: reduced gradients go to the masters
        self._reset()

    def _reset(self) -> None:
        self.waiting = [len(bucket.slots) for bucket in self.buckets]  # params still without a gradient
        self.ready = [False] * len(self.bucket_of)
        self.next_bucket = 0  # buckets before this one are launched
        self.launched_in_backward = 0  # how many were overlapped with backward (the rest waited for flush)

    def arm(self, roots: Sequence[torch.Tensor], final: bool) -> None:
        """The coming backward from `roots` (the loss; a pipeline stage's outputs) must reduce gradients (an
        accumulation boundary, or stage 2); `final`: it ends the accumulation window."""
        self._reset()
        self.armed, self.final = True, final
        used = params_in_graph(roots)
        for param_id, index in self.index_of.items():
            if param_id not in used:
                self.grad_ready(index)

    def arm_accumulated(self) -> None:
        """Reduce the gradients a whole window accumulated, after its backwards (Engine.reduce_deferred): every
        parameter is complete now; which ones were used, the hooks marked as their gradients came."""
        self._reset()
        self.armed, self.final = True, True
        for index in range(len(self.ready)):
            self.grad_ready(index)

    def grad_arrived(self, param_index: int) -> None:
        """A gradient hook: params[param_index] got its gradient for this backward."""
        self.stage.usage.mark(param_index)
        self.grad_ready(param_index)

    def grad_ready(self, param_index: int) -> None:
        """Its gradient is complete for this backward (arrived, or none will: see arm)."""
        if not self.armed:
            return  # gradients accumulate locally on this micro-step
        bucket_index = self.bucket_of[param_index]
        if bucket_index < self.next_bucket:
            raise RuntimeError(
                f"rank {self.stage.rank}: parameter {param_index} received a second gradient after its bucket was "
                "reduced; use torch.utils.checkpoint(..., use_reentrant=False) for checkpointed modules")
        self.stage.on_grad_ready(param_index)
        if not self.ready[param_index]:
            self.ready[param_index] = True
            self.waiting[bucket_index] -= 1
        if self.overlap:
            while self.next_bucket < len(self.buckets) and self.waiting[self.next_bucket] == 0:
                self._launch_next()
                self.launched_in_backward += 1

    def _launch_next(self) -> None:
        bucket = self.buckets[self.next_bucket]
        self.next_bucket += 1
        self.in_flight.append((bucket, self.stage.reduce_bucket(bucket)))
        if len(self.in_flight) > self.max_in_flight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        bucket, reduction = self.in_flight.popleft()
        reduction.complete()
        if self.final:
            self.stage.grad_final(bucket)

    def flush(self) -> None:
        """After backward: launch what is left (parameters without gradients count as zero) and wait."""
        if not self.armed:
            return
        self._launch_rest()
        while self.in_flight:
            self._complete_oldest()
        self.armed = False

    def launch_remaining(self) -> None:
        """In the middle of backward, launch every bucket not launched yet, waiting for none: a stage-3 rank that
        cannot follow the backward's agreed order any more must not keep another rank waiting for one of its
        reductions (See [Note: stage-3 units every rank agrees on] in stages/agreement.py). This backward
        cannot go on after it: a gradient that arrives later finds its bucket reduced."""
        if self.armed:
            self.max_in_flight = len(self.buckets)
            self._launch_rest()

    def _launch_rest(self) -> None:
        while self.next_bucket < len(self.buckets):
            for slot in self.buckets[self.next_bucket].slots:
                if not self.ready[slot.param_index]:
                    self.stage.on_grad_ready(slot.param_index)
            self._launch_next()


def params_in_graph(roots: Sequence[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors whose gradients backward from `roots` will produce."""
    found: set[int] = set()
    seen: set = set()
    stack = [root.grad_fn for root in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
