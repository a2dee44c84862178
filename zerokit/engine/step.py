"""engine.step(): at an accumulation boundary, the global norm and overflow check, the loss scale's update, clipping,
the optimizer step on the masters, publishing them, and the LR schedules; between boundaries, nothing but the
report. `Progress` is where training stands, which a checkpoint restores beside the model states.

[Note: one norm across the pipeline]
Under a pipeline each stage's engine holds the gradients of its own layers only, so its norm (over its data group:
See [Note: one scalar decides overflow and norm] in precision/norm.py) is one stage's. One more scalar all-reduce, of
its square over the pipeline group, makes it the model's: clipping then scales every stage by one coefficient, as
one process would, and an inf or nan on any stage or replica is a nan on every rank, so that every rank skips the
step and halves the fp16 loss scale together. A replica's data group agrees on its norm before the sum, so the
ranks of every pipeline group add the same values. (The square of a square root: float64, exact to ~1e-16.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from zerokit.comm import Communicator
from zerokit.observe.monitor import Lap, no_lap
from zerokit.precision.arithmetic import clip_coefficient
from zerokit.precision.norm import global_norm
from zerokit.precision.result import StepResult
from zerokit.precision.scaler import DynamicLossScaler, NoLossScaler
from zerokit.reliability import Safeguards
from zerokit.stages import ZeroStage
from zerokit.config.settings import StepSettings
from zerokit.parallel.tensor import TensorShare


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
                 safeguards: Safeguards, part: StepSettings, tensor: TensorShare | None = None,
                 other_stages: Communicator | None = None, experts: ZeroStage | None = None) -> None:
        """`part`: the step's settings (clipping, the skips allowed in a row). `tensor`: the tensor group of a
        tensor-parallel model, whose ranks' squares the norm adds up (See [Note: each element counted once across
        tensor and data ranks] in zerokit/parallel/tensor/share.py); None without one.
        `other_stages`: the pipeline group, whose ranks hold the model's other stages (See [Note: one norm across the
        pipeline]); None without a pipeline. `experts`: the stage of MoE experts split over ranks, stepped with this one
        by one norm and one optimizer (See [Note: ZeRO over experts split across ranks] in
        zerokit/parallel/experts/share.py); None without."""
        self.stage, self.loss_scaler, self.lr_schedules, self.safeguards = stage, loss_scaler, lr_schedules, safeguards
        self.gradient_clipping = part.gradient_clipping
        self.max_consecutive_skips = part.max_consecutive_skipped_steps
        self.tensor, self.other_stages, self.experts = tensor, other_stages, experts
        self._uncounted = frozenset() if tensor is None else tensor.uncounted(stage.flat.params)

    def exclude_from_norm(self, param_indices: set[int]) -> None:
        """Leave these parameters (indices in stage.flat.params) out of this rank's share of the global norm too:
        copies of a weight tied across pipeline stages, counted on the first stage that holds it (as DeepSpeed counts
        a tied weight once: ds_pipe_replicated)."""
        self._uncounted = self._uncounted | frozenset(param_indices)

    def step(self, progress: Progress, lap: Lap = no_lap) -> StepResult:
        """Step the optimizer if the last backward ended an accumulation window; report either way. `lap(phase)`
        charges the time since the last lap to one of the step's phases (wall_clock_breakdown: zerokit/observe)."""
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
        stages = [stage] if self.experts is None else [stage, self.experts]
        norm = self._norm_and_usage(squares) if self.experts is None else self._with_experts(squares)
        overflow = norm != norm  # nan: some gradient was inf or nan on some rank
        self.loss_scaler.update(overflow)
        lap("optimizer_gradients")
        if overflow:
            for each in stages:
                each.release_grads()
            return self._skip(progress)
        coefficient = clip_coefficient(norm, self.gradient_clipping)
        for each in stages[1:]:  # the experts' masters: the one optimizer below steps them with the dense ones
            each.masters.drop_unused(each.usage.agreed)
            each.masters.clip(coefficient)
        masters.drop_unused(stage.usage.agreed)
        masters.step(coefficient)
        lap("optimizer_step")
        for each in stages:
            each.release_grads()
            each.publish_params()
        lap("optimizer_allgather")
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
            return self._across_stages(global_norm(squares, None))
        flags = usage.flags(torch.float64, comm.device)
        norm = global_norm(squares, comm, flags)  # over the shard group: its replicas hold the same shards
        replicas = self.stage.replica_comm
        if replicas is not None:  # but each replica's ranks used parameters of their own (See [Note: hybrid sharding])
            replicas.all_reduce(flags, op=dist.ReduceOp.SUM, purpose="which parameters each rank used, across replicas")
        usage.agree(flags)
        return self._across_stages(norm)

    def _with_experts(self, squares: float) -> float:
        """The norm over the dense gradients (`squares`, this rank's) and the split experts' together, and which
        expert parameters each rank of their expert-data group used (See [Note: ZeRO over experts split across
        ranks] in zerokit/parallel/experts/share.py)."""
        experts = self.experts
        mine = experts.masters.unscaled_square_sum(self.loss_scaler.scale)
        if experts.norm_comm is not None:  # stages 1-3: each expert element is on one rank; its usage agreed here
            flags = experts.usage.flags(torch.float64, experts.comm.device)
            experts.comm.all_reduce(flags, op=dist.ReduceOp.SUM, purpose="which expert parameters each rank used")
            experts.usage.agree(flags)  # (stage 0 agreed in its last bucket's all-reduce)
            return self._norm_and_usage(squares + mine)
        # stage 0: the ranks of an expert-data group hold the same full gradients, so its first counts them (the
        # others' times zero: an inf still counts), and one more scalar sums them over every rank
        counted = torch.tensor([mine if experts.comm.rank == 0 else 0.0 * mine], dtype=torch.float64,
                               device=self.stage.comm.device)
        self.stage.comm.all_reduce(counted, op=dist.ReduceOp.SUM, purpose="the split experts' gradient norm")
        dense = self._norm_and_usage(squares)
        total = dense * dense + counted.item()
        return math.sqrt(total) if math.isfinite(total) else float("nan")

    def _across_stages(self, norm: float) -> float:
        """The norm over every stage's gradients from this stage's. See [Note: one norm across the pipeline]."""
        if self.other_stages is None:
            return norm
        squared = torch.tensor([norm * norm], dtype=torch.float64, device=self.other_stages.device)
        self.other_stages.all_reduce(squared, op=dist.ReduceOp.SUM, purpose="the gradient norm across pipeline stages")
        return math.sqrt(squared.item())

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
