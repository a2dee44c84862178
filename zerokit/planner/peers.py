"""What the peers' estimators answer for the same question, re-implemented from their sources so
the memo can show, with numbers, where and why they differ from ours.

- DeepSpeed `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py):
  no offload GPU 2P + 18P/N ("18 = 2 16-bit grads + 4 fp32 grads + 4 fp32 params + 8 optimizer
  states"), host 4P x GPUs per node x 1.5; optimizer offload GPU 2P, host P x max(4 N, 16) x 1.5.
- DeepSpeed `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py), with
  zero_init: no offload GPU 4L + 18P/N; optimizer offload GPU 4L + 2P/N, host 16P/nodes x 1.5;
  optimizer + parameter offload GPU 4L, host 18P/nodes x 1.5. L is the largest module's own
  parameters (`model_to_params`: a module's parameters with recurse=False).
- `accelerate estimate-memory` (src/accelerate/commands/estimate.py, `estimate_training_usage`):
  one device, batch 1, and the *largest* of model, gradients, optimizer and step, not their sum:
  16-bit -> max(4P, 6P, 8P, 8P) = 8P; fp32 -> max(4P, 4P, 8P, 16P) = 16P.
All are model states only: no activations, communication buffers or CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerokit.planner.models import Architecture

ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's default `additional_buffer_factor`


@dataclass(frozen=True)
class PeerEstimate:
    tool: str
    options: str
    gpu_bytes: int
    host_bytes: int | None
    formula: str


def deepspeed_zero2(total: int, gpus_per_node: int, nodes: int, cpu_offload: bool,
                    factor: float = ADDITIONAL_BUFFER_FACTOR) -> tuple[int, int]:
    """(host bytes, GPU bytes), as DeepSpeed's function returns them (cpu_mem, gpu_mem)."""
    total_gpus = nodes * gpus_per_node
    if cpu_offload:
        return int(total * max(4 * total_gpus, 16) * factor), int(2 * total)
    return int(total * 4 * gpus_per_node * factor), int(2 * total + int(18 * total / total_gpus))


def deepspeed_zero3(total: int, largest_layer: int, gpus_per_node: int, nodes: int, cpu_offload: bool,
                    cpu_offload_params: bool, factor: float = ADDITIONAL_BUFFER_FACTOR) -> tuple[int, int]:
    """(host bytes, GPU bytes) of DeepSpeed's ZeRO-3 estimator with zero_init=True."""
    total_gpus, per_node = nodes * gpus_per_node, 1 / nodes
    largest = 4 * largest_layer
    if cpu_offload and cpu_offload_params:
        return int(total * 18 * per_node * factor), int(largest)
    if cpu_offload:
        return int(total * 16 * per_node * factor), int(largest + int(2 * total / total_gpus))
    return int(largest_layer * 4 * gpus_per_node * factor), int(largest + int(18 * total / total_gpus))


def accelerate_training(total: int, precision: str) -> int:
    """`accelerate estimate-memory`'s "Training using Adam" column: max over its four sizes."""
    fp32_size = 4 * total
    if precision == "fp32":
        sizes = (fp32_size, fp32_size, 2 * fp32_size, 4 * fp32_size)
    else:
        sizes = (fp32_size, fp32_size + fp32_size // 2, 2 * fp32_size, 2 * fp32_size)
    return max(sizes)


def deepspeed_largest_layer(arch: Architecture) -> int:
    """The biggest single module's own parameters: embedding, head or one linear layer."""
    linears = max(d_in * d_out for d_in, d_out in arch.projections().values())
    return max(arch.vocab * arch.hidden, arch.max_positions * arch.hidden, linears)


def peer_estimates(total: int, largest_layer: int, gpus_per_node: int, nodes: int,
                   precision: str) -> tuple[PeerEstimate, ...]:
    n = gpus_per_node * nodes
    z2 = deepspeed_zero2(total, gpus_per_node, nodes, cpu_offload=False)
    z2_off = deepspeed_zero2(total, gpus_per_node, nodes, cpu_offload=True)
    z3 = deepspeed_zero3(total, largest_layer, gpus_per_node, nodes, False, False)
    z3_opt = deepspeed_zero3(total, largest_layer, gpus_per_node, nodes, True, False)
    z3_all = deepspeed_zero3(total, largest_layer, gpus_per_node, nodes, True, True)
    ds2, ds3 = "DeepSpeed estimate_zero2_model_states_mem_needs", "DeepSpeed estimate_zero3_model_states_mem_needs"
    return (
        PeerEstimate(ds2, "offload_optimizer=none", z2[1], z2[0], f"2P + 18P/{n}; host 4P x {gpus_per_node} x 1.5"),
        PeerEstimate(ds2, "offload_optimizer=cpu", z2_off[1], z2_off[0], f"2P; host P x max(4 x {n}, 16) x 1.5"),
        PeerEstimate(ds3, "no offload", z3[1], z3[0], f"4L + 18P/{n}; host 4L x {gpus_per_node} x 1.5"),
        PeerEstimate(ds3, "offload_optimizer=cpu", z3_opt[1], z3_opt[0], f"4L + 2P/{n}; host 16P/{nodes} x 1.5"),
        PeerEstimate(ds3, "offload_optimizer=cpu, offload_param=cpu", z3_all[1], z3_all[0],
                     f"4L; host 18P/{nodes} x 1.5"),
        PeerEstimate("accelerate estimate-memory", f"{'float32' if precision == 'fp32' else 'float16'}, one device",
                     accelerate_training(total, precision), None,
                     "max(model, gradients, optimizer, step) = " + ("16P" if precision == "fp32" else "8P")),
    )
