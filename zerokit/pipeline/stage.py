"""This rank's pipeline stage as torch's schedules drive it, with a zerokit engine under it.

[Note: a pipeline stage's engine]
torch's schedules (ScheduleGPipe, Schedule1F1B) run a stage's backward themselves: the last stage calls autograd
on the loss, the others on their outputs with the gradients the next stage sent back, one micro-batch at a time,
interleaved with other micro-batches' forwards. They never call engine.backward. So the stage subclasses torch's
PipelineStage at the one method every schedule's backward goes through (backward_maybe_with_nosync, where torch
itself adapts DDP and FSDP) and wraps each micro-batch's backward in engine.external_backward(outputs): the engine
arms its reductions exactly as engine.backward would, counting the schedule's micro-batches as the accumulation
window's micro-steps (gradient_accumulation_steps = the schedule's micro-batch count), so at stages 0-1 (and 2 with
reduce_every_micro_step off) the gradients are reduced once per optimizer step, at the window's last micro-batch,
which is the schedule's `last_backward`. The loss is divided by the micro-batch count (and multiplied by the fp16
loss scale) before the schedule's backward sees it, so the schedule's own scale_grads is off: it divides `.grad`,
which ZeRO has already moved into its buckets.
Zero-bubble schedules split backward into an input half and a weight half, and the weight half's gradients come
outside this window; they are refused (PipelineStage's "input"/"weight" backward types).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from zerokit.engine.engine import Engine


def engine_stage(engine: Engine, stage_index: int, num_stages: int, defer_reduction: bool = False) -> Any:
    """torch's PipelineStage over `engine.module`, whose backwards the engine reduces. See [Note: a pipeline stage's
    engine]. defer_reduction: the window's last backward leaves its gradients for the caller to reduce after the
    schedule (See [Note: a tied weight's gradient across stages] in tied.py)."""
    return _engine_stage_class()(engine, stage_index, num_stages, defer_reduction)


@cache
def _engine_stage_class() -> type:
    """Made on first use: torch.distributed.pipelining imports torch._dynamo, which zerokit does not need otherwise."""
    from torch.distributed.pipelining import PipelineStage

    class EngineStage(PipelineStage):
        def __init__(self, engine: Engine, stage_index: int, num_stages: int, defer_reduction: bool) -> None:
            group = engine.stages_comm.group if engine.stages_comm is not None else None  # None: one stage, no p2p
            super().__init__(engine.module, stage_index, num_stages, engine.device, group=group)
            self.engine, self.defer_reduction = engine, defer_reduction
            self.sent_bytes = 0  # activations and their gradients sent to the neighbouring stages, since start

        def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
            return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
            return self._counted(super().get_bwd_send_ops(bwd_chunk_id))

        def _counted(self, ops: list) -> list:
            self.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

        def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
                                       ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
            _refuse_split_backward(backward_type)
            roots = [t for t in tree_flatten(bwd_kwargs["stage_output"])[0]
                     if isinstance(t, torch.Tensor) and t.requires_grad]
            with self.engine.external_backward(roots, defer_reduction=self.defer_reduction):
                result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            if self.engine.progress.window_ended != last_backward:
                raise RuntimeError(f"rank {self.engine.rank}: the schedule's last backward and the engine's "
                                   "accumulation window disagree (an internal bug: gradient_accumulation_steps must "
                                   "be the schedule's micro-batch count)")
            return result

    return EngineStage


def _refuse_split_backward(backward_type: str) -> None:
    if backward_type != "full":
        raise ValueError(f"a schedule that splits backward into input and weight halves ({backward_type!r}: the "
                         "zero-bubble schedules) is not supported with a zerokit engine; accepted: ScheduleGPipe, "
                         "Schedule1F1B")
