"""A micro-step's backward, the engine's own (Engine.backward) or one a caller runs itself (torch's pipeline
schedules: external_backward), with the reductions it needs armed before and flushed after. See [Note: a pipeline
stage's engine] in zerokit/pipeline/stage.py."""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Any, Iterator, Sequence

import torch


class ExternalBackward:
    """Engine's backwards run by someone else (a mixin of Engine: it uses the engine's stage, reducer and progress)."""

    _deferred = False  # a window's last backward left its reductions to reduce_deferred()

    def rooms(self) -> list[tuple[Any, Any]]:
        """Each stage with the reducer its gradients fill: the model's, and the split experts' where there are (See
        [Note: ZeRO over experts split across ranks] in zerokit/parallel/experts/share.py)."""
        rooms = [(self.stage, self.reducer)]
        return rooms if self.expert_stage is None else rooms + [(self.expert_stage, self.expert_reducer)]

    def external_backward(self, outputs: Sequence[torch.Tensor], defer_reduction: bool = False
                          ) -> AbstractContextManager[None]:
        """Around one micro-step's backward that the caller runs from `outputs` itself (torch's pipeline schedules),
        with backward()'s reductions; the caller scales the loss by loss_scaler.scale / gradient_accumulation_steps.
        defer_reduction: the window's last micro-step leaves its gradients for reduce_deferred(). See [Note: a
        pipeline stage's engine] in zerokit/pipeline/stage.py."""
        self._refuse_if_closed("backward")
        if defer_reduction and self.stage.reduces_every_micro_step:
            raise ValueError(f"ZeRO stage {self.config.stage} reduces every micro-step, so a window's reduction "
                             "cannot be deferred; accepted: stages 0-1, and 2 with reduce_every_micro_step false")
        return micro_step(self, list(outputs), observed=None, defer=defer_reduction)

    def reduce_deferred(self) -> None:
        """The reductions that external_backward(defer_reduction=True) left at a window's end: every bucket, now."""
        if not self._deferred:
            raise RuntimeError(f"rank {self.rank}: reduce_deferred() without a deferred window (an internal bug)")
        self._deferred = False
        self.reducer.arm_accumulated()
        self.reducer.flush()
        self.stage.finish_backward()


@contextmanager
def micro_step(engine: Any, roots: list[torch.Tensor], observed: torch.Tensor | None, defer: bool = False
               ) -> Iterator[None]:
    """One micro-step's backward from `roots` (run inside), the reductions it needs armed before and flushed
    after; `defer`: at the window's end, not yet (See ExternalBackward.reduce_deferred)."""
    engine.safeguards.before_backward(engine.progress.backward_since_step, engine.progress.window_ended)
    final = engine.at_boundary
    deferred = defer and final
    must_reduce = (final or engine.stage.reduces_every_micro_step) and not deferred
    rooms = engine.rooms()  # the model's stage, and the split experts' (See parallel/experts/share.py)
    with engine.monitor.backward(observed) as lap:  # observability (zerokit/observe): the loss, phase times, FLOPs
        for stage, reducer in rooms:
            stage.prepare_backward()
            if must_reduce:
                reducer.arm(roots, final=final)
        yield
        for stage, _ in rooms:
            stage.end_of_autograd()  # stage 3: agree that every rank is done gathering
        lap("backward_inner")
        for _, reducer in rooms:
            reducer.flush()
        lap("backward_reduce")
        if not deferred:
            for stage, _ in rooms:
                stage.finish_backward()
    engine._deferred = deferred
    engine.progress.micro_step += 1
    engine.progress.backward_since_step = True
    engine.progress.window_ended = final
