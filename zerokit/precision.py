"""Loss scaling, the global gradient norm across shards, clipping: written once, used by every stage.

[Note: one scalar decides overflow and norm]
The squared gradient norm is inf or nan exactly when some gradient element is (or when a finite
gradient is so large its square overflows fp32, which is no better). So every rank sums the squares
of the gradient elements it owns, one scalar all-reduce adds them up, and that single number gives
both the global norm for clipping and the overflow decision, identical on all ranks by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerokit.comm import Communicator
from zerokit.config import LossScaling


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaling: halve on overflow (after `hysteresis` overflows), double
    after `window` clean steps, never below `min_scale`."""

    def __init__(self, policy: LossScaling) -> None:
        self.policy = policy
        self.scale = policy.static_scale or float(2 ** policy.initial_scale_power)
        self._clean_steps = 0
        self._hysteresis_left = policy.hysteresis

    @property
    def is_dynamic(self) -> bool:
        return self.policy.static_scale is None

    def update(self, overflow: bool) -> None:
        if not self.is_dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2, self.policy.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps % self.policy.window == 0:
                self.scale *= 2
                self._hysteresis_left = self.policy.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


class NoLossScaler:
    """bf16 and fp32: scale 1, nothing to update."""

    scale = 1.0
    is_dynamic = False

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": 1.0}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        if state.get("scale", 1.0) != 1.0:
            raise ValueError(f"the saved loss scale is {state['scale']}, but this run does not use fp16 loss scaling")


def make_loss_scaler(policy: LossScaling | None) -> DynamicLossScaler | NoLossScaler:
    return DynamicLossScaler(policy) if policy is not None else NoLossScaler()


NORM_CHUNK_NUMEL = 1 << 15  # 256 KiB of float64


def global_grad_norm(grads: list[torch.Tensor], comm: Communicator | None, flags: torch.Tensor | None = None) -> float:
    """L2 norm over all gradient elements of all ranks. Pass `comm` when each rank holds a different
    shard (their squares are summed across ranks), None when every rank holds the same full gradients.
    Squares are summed in float64, so the norm (and the clip coefficient) does not depend on how the
    parameters happen to be split into shards and buckets. See [Note: one scalar decides overflow and norm].
    `flags` (1-D float64), when given with `comm`, are summed across ranks, in place, by the same
    all-reduce (See [Note: parameters no rank used] in stages/usage.py)."""
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        # In cache-sized chunks: the float64 copy stays small and hot (8x faster on the CPU than a
        # bucket-sized copy, which also showed up in peak memory); each square of an fp32 is exact.
        for chunk in grad.reshape(-1).split(NORM_CHUNK_NUMEL):
            as_double = chunk.double()
            squares += torch.dot(as_double, as_double)
    if comm is not None:
        packed = squares.reshape(1) if flags is None else torch.cat([squares.reshape(1), flags.to(squares)])
        comm.all_reduce(packed, op=dist.ReduceOp.SUM)
        squares = packed[0]
        if flags is not None:
            flags.copy_(packed[1:])
    total = squares.item()
    return math.sqrt(total) if math.isfinite(total) else float("nan")


def unscale_(grads: list[torch.Tensor], scale: float) -> None:
    if scale != 1.0 and grads:
        torch._foreach_mul_(grads, 1.0 / scale)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor `torch.nn.utils.clip_grad_norm_` applies: max_norm / (norm + 1e-6), at most 1."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


@dataclass(frozen=True)
class StepResult:
    """What one call to `engine.step()` did. Every field is visible on every step, so a run that stops
    updating (loss-scale spiral, inf gradients) is loud, not silent."""

    micro_step: int  # micro-steps taken so far, this one included
    optimizer_step: int  # optimizer steps taken so far (skipped ones not counted)
    boundary: bool  # this micro-step ended an accumulation window
    stepped: bool  # the optimizer ran and parameters changed
    skipped: bool  # a boundary step thrown away because gradients were inf/nan
    loss_scale: float
    grad_norm: float | None  # global norm before clipping (None off the boundary)
    clipped: bool
    consecutive_skips: int
    total_skips: int
