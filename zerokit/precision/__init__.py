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
from zerokit.config.typed import LossScaling


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaling: halve on overflow (after `hysteresis` overflows), never below
    `min_scale`; double at a clean step that follows a multiple of `window` clean steps since the last overflow
    (DeepSpeed 0.19.8's stable_interval, runtime/fp16/loss_scaler.py: the first doubling comes at the
    window + 1st clean step, then every `window`)."""

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
            stable = self._clean_steps  # clean steps before this one, since the last overflow
            self._clean_steps += 1
            if stable > 0 and stable % self.policy.window == 0:
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


# [Note: the float64 sum of squares in chunks]
# Each gradient is squared and summed in float64 a chunk at a time. On the CPU, cache-sized chunks keep the
# float64 copy small and hot (8x faster than a bucket-sized copy, which also showed up in peak memory); a chunk is
# 32K elements (256 KiB of float64) for each of torch's threads, as torch splits an element-wise op into 32K-element
# grains: a chunk of one grain runs on one thread however many the host has. Over 150M host elements (2 threads,
# this 2-core machine) 32K-element chunks took 0.16-0.19 s, 64K ones 0.09 s. (An offloaded optimizer's squares are
# summed where its gradients were reduced: See [Note: squares taken before the gradient leaves the device] in
# zerokit/tiers/homes.py.) On a GPU each chunk is three kernel launches: 256 KiB chunks
# made 31,000 launches a step for 337M parameters, and the step took 0.28 s where torch's took 0.01 s (H200,
# benchmarks/bench_gpu.py); 32 MiB chunks make about 240.
CPU_NORM_CHUNK_NUMEL_PER_THREAD = 1 << 15
CUDA_NORM_CHUNK_NUMEL = 1 << 22  # 32 MiB of float64


def norm_chunk_numel(device: torch.device) -> int:
    """Elements of one float64 chunk of the sum of squares on `device`: See [Note: the float64 sum of squares in
    chunks]."""
    if device.type == "cpu":
        return CPU_NORM_CHUNK_NUMEL_PER_THREAD * torch.get_num_threads()
    return CUDA_NORM_CHUNK_NUMEL


def square_sum(grads: list[torch.Tensor], chunk_numel: int | None = None) -> float:
    """The sum of the squares of every element, in float64: exact for each fp32 square, and the same however
    the parameters happen to be split into shards and buckets. Tensors may live on several devices. `chunk_numel`:
    elements squared in float64 at a time (None: the device's, See norm_chunk_numel)."""
    return float(sum(device_square_sum(group, chunk_numel).item() for group in by_device(grads).values()))


def device_square_sum(grads: list[torch.Tensor], chunk_numel: int | None = None) -> torch.Tensor:
    """square_sum of tensors on one device, as a 0-d float64 tensor there: nothing waits for the device."""
    device = grads[0].device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    chunk_size = chunk_numel or norm_chunk_numel(device)
    for grad in grads:  # See [Note: the float64 sum of squares in chunks]
        for chunk in grad.reshape(-1).split(chunk_size):
            as_double = chunk.double()
            squares += torch.dot(as_double, as_double)
    return squares


def unscaled_square_sum(grads: list[torch.Tensor], taken: list[torch.Tensor | None], scale: float) -> float:
    """square_sum of `grads`, already divided by the loss `scale`, where `taken[i]` is None; where it is not, it is
    grads[i]'s sum of squares taken before that division (by an offload tier, on the device: See [Note: squares taken
    before the gradient leaves the device] in zerokit/tiers/homes.py), divided by scale squared here."""
    total = square_sum([grad for grad, squares in zip(grads, taken) if squares is None])
    for sums in by_device([squares for squares in taken if squares is not None]).values():
        total += torch.stack(sums).sum().item() / (scale * scale)
    return total


def by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def global_norm(squares: float, comm: Communicator | None, flags: torch.Tensor | None = None) -> float:
    """The L2 norm from this rank's sum of squares. Pass `comm` when each rank holds a different shard
    (the sums are added across ranks), None when every rank holds the same full gradients. See [Note: one
    scalar decides overflow and norm]. `flags` (1-D float64), when given with `comm`, are summed across
    ranks, in place, by the same all-reduce (See [Note: parameters no rank used] in stages/usage.py)."""
    if comm is not None:
        packed = torch.tensor([squares], dtype=torch.float64, device=comm.device)
        if flags is not None:
            packed = torch.cat([packed, flags.to(packed)])
        comm.all_reduce(packed, op=dist.ReduceOp.SUM, purpose="the boundary norm (and which parameters each rank used)")
        squares = packed[0].item()
        if flags is not None:
            flags.copy_(packed[1:])
    return math.sqrt(squares) if math.isfinite(squares) else float("nan")


def global_grad_norm(grads: list[torch.Tensor], comm: Communicator | None, flags: torch.Tensor | None = None) -> float:
    """L2 norm over all gradient elements of all ranks: global_norm of their square_sum."""
    return global_norm(square_sum(grads), comm, flags)


def scale_(tensors: list[torch.Tensor], factor: float) -> None:
    """Multiply every tensor by `factor` in place (one foreach call per device)."""
    if factor != 1.0:
        for group in by_device(tensors).values():
            torch._foreach_mul_(group, factor)


def unscale_(grads: list[torch.Tensor], scale: float) -> None:
    scale_(grads, 1.0 / scale)


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
