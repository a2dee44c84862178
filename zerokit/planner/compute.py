"""Compute time and offload time per optimizer step.

[Note: compute model]
Training FLOPs per token (PaLM, Chowdhery et al. 2022, Appendix B: 6N + 12 L H Q T): forward 2N
plus 4 L q s for attention scores and values; backward twice the forward for activation gradients
and weight gradients, except that frozen weights need no weight gradient, so backward is
2N + 2N_t + 8 L q s; full activation checkpointing repeats the forward once more (x4/3 for a fully
trainable model, Korthikanti et al. 2022). N counts the parameters that multiply every token (not
the embedding lookup); q = heads x head_dim; s = sequence length. Time = FLOPs / (peak x MFU).
With only a parameter count, N is all parameters and attention FLOPs are left out.

[Note: offload model]
ZeRO-Offload (Ren et al. 2021, Section 4): per step the gradient shard goes down PCIe (overlapping
backward), the optimizer runs on the CPU, and the updated 16-bit shard comes back up. Per rank and step,
with shard = Psi_t / N_d trainable elements, m micro-steps, p / r bytes of the compute / reduce dtype, as
zerokit's engine moves them (exact per bucket, padding included: engine_offload.engine_transfers):
    down    shard x r once per step: the engine accumulates the reduced shard on the device over the
            micro-steps and hands it to the host at the accumulation boundary (x 4 with the optimizer on
            NVMe, whose shard is widened to fp32 on the device first)
    up      shard x p, only while the parameter shards live on the device: offloaded parameters take the
            update where they live (NVMe: written, shard x p)
    fetch   stage 3 with offloaded parameters: every gather copies the rank's shard to the device, each
            block before its forward and again before its backward, the root once per micro-step:
            m x (2 Psi - Psi_root) / N_d x p (NVMe: read from disk too)
    NVMe    the optimizer's record is read and written once per step: the fp32 master (a separate one
            even in fp32 training, where K leaves it out) and the optimizer's state, K (+ 4 in fp32)
            bytes per element
This architecture-level form leaves out bucket padding, the 64-byte alignment and 4 KiB rounding of NVMe
records, Adam's per-piece step counts, a persistent root's once-per-step gather, the host cache of NVMe
parameters (max_in_cpu: assumed to hold none) and the NVMe read-ahead the step's writes overtake.
The CPU step is memory-bound, so we price it at the bytes an update touches per element against the
node's RAM bandwidth: read and write the fp32 master and the optimizer's state, 2 (K + 4 in fp32, where
K has no master), read the fp32 gradient, 4, and write the compute copy, p: 30 for mixed Adam, 32 for
fp32 Adam. This is the roofline of a fused CPU Adam (DeepSpeedCPUAdam, which DeepSpeed's tutorial puts
at 5-7x torch's CPU Adam), which writes the copy while the master is in registers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerokit.planner.catalogue import Cluster
from zerokit.planner.memory import (
    RankParams,
    optimizer_state_bytes,
    optimizer_state_total,
    owned_params,
    owned_trainable,
)
from zerokit.planner.models import ModelSpec, ParamCounts
from zerokit.planner.spec import Layout, Offload, Training


@dataclass(frozen=True)
class ComputeEstimate:
    flops_per_token: float
    """Whole model, one token, one training pass (forward, backward, any recomputation)."""
    flops: float
    """This rank's share per optimizer step."""
    seconds: float
    """Per optimizer step, pipeline bubble included."""
    forward_seconds: float
    """One micro-step's forward (recomputation excluded)."""
    backward_seconds: float
    """One micro-step's backward (recomputation included)."""
    bubble: float
    """Pipeline bubble fraction (p - 1) / (m + p - 1); 0 without pipelining."""
    optimizer_seconds: float
    """GPU optimizer step (memory-bound), 0 when the optimizer is offloaded."""


def flops_per_token(model: ModelSpec, counts: ParamCounts, training: Training) -> tuple[float, float]:
    """(forward, backward incl. recomputation) FLOPs per token. See [Note: compute model]."""
    arch = model.architecture
    if arch is None:
        matmul, attention = counts.total, 0.0
    else:
        matmul = arch.matmul_params() + (counts.total - model.total_params)  # LoRA adapters multiply too
        attention = 4.0 * arch.n_layers * arch.q_dim * training.seq_len
    trainable_matmul = matmul * counts.trainable / counts.total
    forward = 2.0 * matmul + attention
    backward = 2.0 * matmul + 2.0 * trainable_matmul + 2.0 * attention
    if training.checkpointing == "full":
        backward += forward
    return forward, backward


def gpu_optimizer_seconds(rank: RankParams, training: Training, stage: int, cluster: Cluster,
                          efficiency: float, per_element: float | None = None) -> float:
    """Memory-bound at the device's bandwidth, or the measured (or given) seconds per owned element."""
    elements = owned_trainable(rank, stage)
    if per_element is not None:
        return elements * per_element
    touched = (2 * optimizer_state_bytes(training) + training.grad_bytes
               + (training.param_bytes if training.mixed else 8))
    return elements * touched / (cluster.gpu.hbm_bandwidth * efficiency)


def recomputed_by_tiles(model: ModelSpec, counts: ParamCounts, training: Training) -> float:
    """The share of the forward a tiled MLP and loss compute again in backward (their weights' share of the matrix
    FLOPs: each slice is recomputed once); 0 untiled."""
    arch = model.architecture
    if training.tiles == 1 or arch is None:
        return 0.0
    mlp = (3 if arch.gated_mlp else 2) * arch.hidden * arch.ffn * arch.n_layers
    return min(1.0, (mlp + arch.vocab * arch.hidden) / counts.total)


def compute_estimate(model: ModelSpec, counts: ParamCounts, rank: RankParams, training: Training, layout: Layout,
                     stage: int, offload: Offload, cluster: Cluster, mfu: float, efficiency: float,
                     optimizer_per_element: float | None = None) -> ComputeEstimate:
    forward, backward = flops_per_token(model, counts, training)
    backward += forward * recomputed_by_tiles(model, counts, training)
    achievable = cluster.peak_flops(training.precision) * mfu
    split = layout.tp * layout.pp * layout.sp  # a sequence rank computes 1 / sp of each sequence's tokens and heads
    tokens = training.tokens_per_micro_batch
    forward_s = forward * tokens / split / achievable
    backward_s = backward * tokens / split / achievable
    m, p = training.grad_accum, layout.pp
    bubble = (p - 1) / (m + p - 1)
    busy = m * (forward_s + backward_s)
    optimizer_s = 0.0 if offload.optimizer != "none" else gpu_optimizer_seconds(rank, training, stage, cluster,
                                                                                efficiency, optimizer_per_element)
    return ComputeEstimate(flops_per_token=forward + backward, flops=(forward + backward) * tokens * m / split,
                           seconds=busy / (1 - bubble), forward_seconds=forward_s, backward_seconds=backward_s,
                           bubble=bubble, optimizer_seconds=optimizer_s)


@dataclass(frozen=True)
class OffloadEstimate:
    """Per optimizer step. PCIe bytes are per GPU; NVMe bytes and CPU time are per node."""

    pcie_down: int
    """GPU -> host: gradient shards (and nothing else)."""
    pcie_up: int
    """Host -> GPU: updated 16-bit parameters (unless they are offloaded), and offloaded parameters fetched
    for each pass."""
    pcie_seconds: float
    nvme_read: int
    nvme_write: int
    nvme_seconds: float
    cpu_optimizer_seconds: float
    exposed_seconds: float
    """What the step waits for: PCIe beyond the backward it overlaps, CPU step, NVMe."""

    @staticmethod
    def none() -> OffloadEstimate:
        return OffloadEstimate(0, 0, 0.0, 0, 0, 0.0, 0.0, 0.0)


def host_master_state_bytes(training: Training) -> int:
    """Bytes per element an offloaded master keeps: K, plus the fp32 master that K leaves out in fp32
    training (offloaded, the master is never the device's parameter)."""
    return optimizer_state_bytes(training) + (0 if training.mixed else 4)


def cpu_update_bytes(training: Training) -> int:
    """Bytes of host memory one CPU optimizer update touches per parameter. See [Note: offload model]."""
    return 2 * host_master_state_bytes(training) + 4 + training.param_bytes


def offload_estimate(rank: RankParams, training: Training, stage: int, offload: Offload, cluster: Cluster,
                     efficiency: float, compute: ComputeEstimate) -> OffloadEstimate:
    if not offload.any:
        return OffloadEstimate.none()
    m, node = training.grad_accum, cluster.gpus_per_node
    shard, param_shard = owned_trainable(rank), owned_params(rank)
    root_shard = math.ceil(rank.root / rank.shard)
    # See [Note: offload model]: the reduced shard goes down once per step, in fp32 to an NVMe optimizer
    down = shard * (4 if offload.optimizer == "nvme" else training.reduce_bytes)
    updated = shard * training.param_bytes
    up = updated if offload.params == "none" else 0  # offloaded parameters are updated where they live
    nvme_read = nvme_write = 0
    if offload.optimizer == "nvme":
        state = (optimizer_state_total(rank, training, shard) + (0 if training.mixed else 4 * shard)) * node
        nvme_read, nvme_write = state, state
    fetch = 0
    if offload.params != "none":
        # blocks before their forward and their backward, the root once, every micro-step
        fetch = m * (2 * param_shard - root_shard) * training.param_bytes
        if offload.params == "nvme":
            nvme_read += fetch * node
            nvme_write += updated * node
    pcie = cluster.pcie.bandwidth * efficiency
    down_s, up_s, fetch_s = down / pcie, up / pcie, fetch / pcie
    cpu_s = shard * node * cpu_update_bytes(training) / (cluster.host.ram_bandwidth * efficiency)
    nvme_s = (nvme_read / (cluster.host.nvme_read * efficiency) + nvme_write / (cluster.host.nvme_write * efficiency)
              if nvme_read or nvme_write else 0.0)
    exposed = max(0.0, down_s - m * compute.backward_seconds) + cpu_s + up_s + nvme_s
    # parameter fetches are prefetched beside forward and backward
    exposed += max(0.0, fetch_s - m * (compute.forward_seconds + compute.backward_seconds))
    return OffloadEstimate(pcie_down=down, pcie_up=up + fetch, pcie_seconds=down_s + up_s + fetch_s,
                           nvme_read=nvme_read, nvme_write=nvme_write, nvme_seconds=nvme_s,
                           cpu_optimizer_seconds=cpu_s, exposed_seconds=exposed)

