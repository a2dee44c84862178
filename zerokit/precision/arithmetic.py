"""The leaf math of the step: the float64 sum of squares, scaling gradients in place, the clipping factor. Imports
nothing of zerokit."""

from __future__ import annotations

import torch


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
