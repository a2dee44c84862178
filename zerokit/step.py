"""engine.step(): at an accumulation boundary, the global norm and overflow check, the loss scale's update, clipping,
the optimizer step on the masters, publishing them, and the LR schedules; between boundaries, nothing but the
report. `Progress` is where training stands, which a checkpoint restores beside the model states."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from zerokit.precision import DynamicLossScaler, NoLossScaler, StepResult, clip_coefficient, global_norm
from zerokit.reliability import Safeguards
from zerokit.stages import ZeroStage
from zerokit.tensor import TensorShare


class SkippedStepsError(RuntimeError):
    """Too many optimizer steps in a row were skipped for inf/nan gradients."""


@dataclass
class Progress:
    """Where training stands: what a resumed run must restore besides the model states."""

    micro_step: int = 0
    optimizer_step: int = 0
    consecutive_skips: int = 0
    total_skips: int = 0
    backward_since_step: bool = False  # a second step() after one backward() would step on stale gradients
    window_ended: bool = False  # the last backward ended an accumulation window, so the step() after it steps

    @property
    def inside_window(self) -> bool:
        """Gradients of a window not yet stepped are held (a backward since the last step, or a window begun)."""
        return self.backward_since_step or bool(self.micro_step and not self.window_ended)

    def without_window(self) -> "Progress":
        """This progress with the open window's gradients dropped: nothing held, and the next window ends where
        it would have (See [Note: a save inside an accumulation window] in checkpoint/save.py)."""
        return replace(self, backward_since_step=False, window_ended=True)


class Stepper:
    """One engine's optimizer step. `lr_schedules` is the engine's own list (the drop-in adds to it)."""

    def __init__(self, stage: ZeroStage, loss_scaler: DynamicLossScaler | NoLossScaler, lr_schedules: list[Any],
                 safeguards: Safeguards, gradient_clipping: float, max_consecutive_skips: int,
                 tensor: TensorShare | None = None) -> None:
        """`tensor`: the tensor group of a tensor-parallel model, whose ranks' squares the norm adds up (See [Note:
        each element counted once across tensor and data ranks] in zerokit/tensor/share.py); None without one."""
        self.stage, self.loss_scaler, self.lr_schedules, self.safeguards = stage, loss_scaler, lr_schedules, safeguards
        self.gradient_clipping, self.max_consecutive_skips = gradient_clipping, max_consecutive_skips
        self.tensor = tensor
        self._uncounted = frozenset() if tensor is None else tensor.uncounted(stage.flat.params)

    def step(self, progress: Progress) -> StepResult:
        """Step the optimizer if the last backward ended an accumulation window; report either way."""
        self.safeguards.before_step()  # an engine without an optimizer refuses
        if not progress.backward_since_step:
            raise RuntimeError("engine.step() was called without an engine.backward() since the last step; "
                               "call engine.backward(loss) once before each engine.step()")
        progress.backward_since_step = False
        self.safeguards.at_step()  # broadcast_buffers: equal on every rank between steps too
        if not progress.window_ended:
            return self._result(progress, boundary=False, stepped=False, norm=None, clipped=False)
        stage, masters = self.stage, self.stage.masters
        squares = masters.unscaled_square_sum(self.loss_scaler.scale, self._uncounted)
        if self.tensor is not None:
            squares = self.tensor.sum_squares(squares)
        norm = self._norm_and_usage(squares)
        overflow = norm != norm  # nan: some gradient was inf or nan on some rank
        self.loss_scaler.update(overflow)
        if overflow:
            stage.release_grads()
            return self._skip(progress)
        masters.drop_unused(stage.usage.agreed)
        coefficient = clip_coefficient(norm, self.gradient_clipping)
        masters.step(coefficient)
        stage.release_grads()
        stage.publish_params()
        for schedule in self.lr_schedules:  # only on steps not skipped, as DeepSpeed steps its schedules
            schedule.step()
        progress.optimizer_step += 1
        progress.consecutive_skips = 0
        return self._result(progress, boundary=True, stepped=True, norm=norm, clipped=coefficient < 1.0)

    def _norm_and_usage(self, squares: float) -> float:
        """The global gradient norm from this rank's sum of squares; at stages 1-3 the same all-reduce sums
        which parameters each rank used (stage 0's last bucket carried them: See [Note: parameters no rank
        used])."""
        comm, usage = self.stage.norm_comm, self.stage.usage
        if comm is None:
            return global_norm(squares, None)
        flags = usage.flags(torch.float64, comm.device)
        norm = global_norm(squares, comm, flags)  # over the shard group: its replicas hold the same shards
        replicas = self.stage.replica_comm
        if replicas is not None:  # but each replica's ranks used parameters of their own (See [Note: hybrid sharding])
            replicas.all_reduce(flags, op=dist.ReduceOp.SUM, purpose="which parameters each rank used, across replicas")
        usage.agree(flags)
        return norm

    def _skip(self, progress: Progress) -> StepResult:
        progress.consecutive_skips += 1
        progress.total_skips += 1
        if progress.consecutive_skips >= self.max_consecutive_skips:
            raise SkippedStepsError(
                f"{progress.consecutive_skips} optimizer steps in a row were skipped for inf/nan gradients "
                f"(loss scale now {self.loss_scaler.scale:g}); the model is not training. Lower the learning "
                "rate, check the data, or raise max_consecutive_skipped_steps")
        return self._result(progress, boundary=True, stepped=False, norm=float("nan"), clipped=False)

    def _result(self, progress: Progress, boundary: bool, stepped: bool, norm: float | None,
                clipped: bool) -> StepResult:
        return StepResult(micro_step=progress.micro_step, optimizer_step=progress.optimizer_step, boundary=boundary,
                          stepped=stepped, skipped=boundary and not stepped, loss_scale=self.loss_scaler.scale,
                          grad_norm=norm, clipped=clipped, consecutive_skips=progress.consecutive_skips,
                          total_skips=progress.total_skips)


__all__ = ["Progress", "SkippedStepsError", "Stepper"]
