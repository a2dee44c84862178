"""What a plan is asked about: how the model is trained, laid out, offloaded, and what we assume.

Every input is a frozen dataclass validated where it is built, so a bad value fails with one line
naming the value and what is accepted, before any arithmetic runs (STYLE.md, example 7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zerokit.config.defaults import DEFAULT_BUCKET_BYTES, STAGE3_PARAM_PERSISTENCE_THRESHOLD
from zerokit.config.settings import ELEMENT_BYTES, reduces_by_scatter, reduces_every_micro_step

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "sgd", "muon", "adafactor")
# Optimizers that read a whole tensor: each rank owns whole parameters (See [Note: whole-tensor optimizers] in
# memory.py). "muon": torch.optim.Muon on the blocks' matrices beside AdamW on the rest, as Muon is used.
WHOLE_TENSOR_OPTIMIZERS = ("muon", "adafactor")
CHECKPOINTING = ("none", "full")
ATTENTION = ("flash", "eager")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
BACKENDS = ("nccl", "gloo")
STAGE3_GATHERINGS = ("micro_batch", "step")  # zerokit.pipeline's stage3_gathering
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

BYTES_PER_ELEMENT = ELEMENT_BYTES  # the engine's table (zerokit/config/settings.py)
GB = 10**9  # reports use decimal GB, as the ZeRO paper does; capacities are stored in bytes


def _choice(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not accepted; use one of {', '.join(accepted)}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _fraction(name: str, value: float, *, low: float, high: float, closed_high: bool) -> None:
    # NaN compares false with everything, so test for it before the range (it would pass both bounds)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name}={value!r} must be a number in [{low}, {high}{']' if closed_high else ')'}")
    bad_high = value > high if closed_high else value >= high
    if value < low or bad_high:
        bracket = "]" if closed_high else ")"
        raise ValueError(f"{name}={value!r} must be in [{low}, {high}{bracket}")


@dataclass(frozen=True, kw_only=True)
class Trainable:
    """Which parameters get gradients and optimizer state: all of them, a fraction, or LoRA adapters."""

    fraction: float = 1.0
    """Share of the model's parameters that train (1.0 = full fine-tune or pre-training)."""
    lora_rank: int | None = None
    """LoRA rank r: adapters of r x (d_in + d_out) parameters train, the base model is frozen."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Which projections of every block get an adapter (default: all linear layers)."""

    def __post_init__(self) -> None:
        _fraction("trainable fraction", self.fraction, low=0.0, high=1.0, closed_high=True)
        if self.fraction == 0:
            raise ValueError("trainable fraction=0 trains nothing; give a value in (0, 1] or a LoRA rank")
        if self.lora_rank is not None:
            _positive_int("lora rank", self.lora_rank)
            if self.fraction != 1.0:
                raise ValueError("give a trainable fraction or a LoRA rank, not both")
        if not self.lora_targets:
            raise ValueError("lora targets are empty; use some of " + ", ".join(LORA_TARGETS))
        for target in self.lora_targets:
            _choice("lora target", target, LORA_TARGETS)

    @property
    def is_full(self) -> bool:
        return self.lora_rank is None and self.fraction == 1.0


@dataclass(frozen=True, kw_only=True)
class Training:
    """How one optimizer step runs on every data-parallel rank."""

    precision: str = "bf16"
    """Compute dtype of parameters, gradients and activations; bf16/fp16 keep fp32 master weights."""
    optimizer: str = "adamw"
    seq_len: int = 2048
    micro_batch: int = 1
    """Sequences per rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    checkpointing: str = "none"
    """Activation checkpointing: none, or full (store each block's input, recompute the block)."""
    attention: str = "flash"
    """flash: fused attention keeps no s x s matrix (PyTorch SDPA); eager: softmax is stored."""
    reduce_dtype: str = "fp32"
    """dtype gradients cross the wire in (zerokit's `communication_data_type`, fp32 by default)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Gradient bucket size in bytes of reduce_dtype (DeepSpeed's reduce_bucket_size is elements)."""
    overlap_comm: bool = True
    """Reduce buckets during backward (the engine keeps up to two in flight)."""
    reduce_every_micro_step: bool = True
    """Stage 2 only: False accumulates full gradients and reduce-scatters once per optimizer step."""
    backend: str = "nccl"
    """nccl reduce-scatters gradient buckets at stages 1-3; gloo all-reduces each in place and keeps the
    rank's shard (the engine's choice there: See [Note: reducing a bucket to a shard])."""
    reduce_scatter: bool | None = None
    """zero_optimization.reduce_scatter: True or False forces the choice; None leaves it to the backend."""
    persistence_threshold: int = STAGE3_PARAM_PERSISTENCE_THRESHOLD
    """Stage 3: parameters with fewer elements join the root unit (gathered once per step)."""
    tiles: int = 1
    """Tiled MLP and loss (zerokit/parallel/sequence/tiling.py): each MLP and the logits computed over this many slices
    of the sequence, each recomputed in backward, so one slice's intermediates are alive at a time; 1: none."""
    stage3_gathering: str = "micro_batch"
    """Stage 3 under a pipeline (zerokit.pipeline's stage3_gathering): "micro_batch" gathers every unit for each
    micro-batch's forward and backward; "step" gathers the stage's units once, before the schedule, and holds them
    through the step. The tree tries both (advice.py)."""
    trainable: Trainable = field(default_factory=Trainable)

    def __post_init__(self) -> None:
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _choice("attention", self.attention, ATTENTION)
        _choice("reduce dtype", self.reduce_dtype, PRECISIONS)
        _choice("backend", self.backend, BACKENDS)
        _choice("stage-3 gathering", self.stage3_gathering, STAGE3_GATHERINGS)
        for name in ("seq_len", "micro_batch", "grad_accum", "bucket_bytes", "tiles"):
            _positive_int(name.replace("_", " "), getattr(self, name))

    @property
    def mixed(self) -> bool:
        """16-bit compute with fp32 master weights."""
        return self.precision != "fp32"

    @property
    def param_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def grad_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def act_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def reduce_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.reduce_dtype]

    @property
    def reduces_by_scatter(self) -> bool:
        return reduces_by_scatter(self.backend, self.reduce_scatter)

    def gathers_once_per_step(self, stage: int, layout: "Layout") -> bool:
        """Stage 3 under a pipeline with its units held through the step (zerokit/pipeline/engine.py)."""
        return stage == 3 and layout.pp > 1 and self.stage3_gathering == "step"

    def reduces_every_micro_step(self, stage: int) -> bool:
        """Whether gradients leave the rank every micro-step at `stage` (the engine's decision)."""
        return reduces_every_micro_step(stage, self.reduce_every_micro_step)

    @property
    def widened(self) -> bool:
        """Gradients are reduced in a wider dtype than they are computed in (fp32 for bf16, by default)."""
        return self.reduce_dtype != self.precision

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch


def splits_heads(arch: Any, sp: int) -> bool:
    """Ulysses splits these heads over sp ranks (zerokit/parallel/sequence/attention.py's rule): sp divides the query
    heads, and divides the key/value heads or is a multiple of them (each then repeated onto the ranks)."""
    return arch.n_heads % sp == 0 and (arch.n_kv_heads % sp == 0 or sp % arch.n_kv_heads == 0)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the world is cut: tensor parallel (innermost), ZeRO shard group, replicas, pipeline.

    Ranks are ordered tp -> dp_shard -> replicas -> pp (Megatron's order, tp fastest), so a group
    whose span fits in a node talks over the intra-node link. `dp_shard` is what is left of the world.
    """

    tp: int = 1
    pp: int = 1
    replicas: int = 1
    """Copies of the ZeRO shard group (HSDP; zerokit's and DeepSpeed's MiCS, `mics_shard_size` = world /
    replicas): shard inside a group, all-reduce across groups."""
    secondary: int = 1
    """hpZ (`zero_hpz_partition_size`, stage 3): k consecutive ranks that also hold a secondary copy of the
    parameters, 1/k each; every gather after a step's first forward reads it inside the group."""
    sp: int = 1
    """Ulysses sequence parallelism (`sequence_parallel_size`): sp consecutive ranks share each sequence, s / sp
    tokens each, exchanging heads around attention; ZeRO still shards over every rank, and the sequences read per
    step are the world's / sp (See [Note: the sequence dimension] in zerokit/parallel/mesh.py)."""
    ep: int = 1
    """Expert parallelism (`expert_parallel_size`), inside the data dimension: each block of ep consecutive ranks holds
    every routed expert once, E / ep on each; the ranks at one place of every block (data / ep of them) hold the same
    experts and form its expert-data group, over which ZeRO shards them (See [Note: the expert degree] in
    memory.py and [Note: the expert dimension] in zerokit/parallel/mesh.py)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "replicas", "secondary", "sp", "ep"):
            _positive_int(name, getattr(self, name))
        if self.ep > 1 and (self.tp, self.pp, self.replicas, self.secondary, self.sp) != (1, 1, 1, 1, 1):
            raise ValueError(f"the planner prices expert parallelism (ep={self.ep}) over flat data parallelism only, "
                             f"not with tp={self.tp}, pp={self.pp}, sp={self.sp}, replicas={self.replicas} or "
                             f"hpZ k={self.secondary}")
        if self.sp > 1 and (self.tp, self.pp, self.secondary) != (1, 1, 1):
            raise ValueError(f"sequence parallelism (sp={self.sp}) composes with ZeRO's data parallelism (flat or "
                             f"replicas), not with tp={self.tp}, pp={self.pp} or hpZ k={self.secondary}")
        if self.secondary > 1 and (self.tp, self.pp, self.replicas) != (1, 1, 1):
            raise ValueError(f"hpZ (secondary={self.secondary}) shards over every rank of a flat data-parallel job; "
                             f"it does not combine with tp={self.tp}, pp={self.pp}, replicas={self.replicas}: "
                             "use one of them")

    @property
    def hybrid(self) -> str:
        """"mics", "hpz" or "" (flat): the hybrid sharding mode, as the memo and the emitters name it."""
        return "hpz" if self.secondary > 1 else "mics" if self.replicas > 1 else ""

    def dp_shard(self, world: int) -> int:
        """ZeRO's shard degree N_d for a world of `world` ranks; raises if the layout does not fit."""
        cut = self.tp * self.pp * self.replicas
        if world % cut:
            raise ValueError(f"world size {world} does not fit the layout tp={self.tp} x pp={self.pp} x "
                             f"replicas={self.replicas}: {world} is not divisible by {cut}")
        if (world // cut) % self.sp:
            raise ValueError(f"sp={self.sp} sequence ranks do not divide ZeRO's shard group of {world // cut} ranks")
        if (world // cut) % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the {world // cut} GPUs of the data-parallel group: "
                             "use a divisor of them (usually of the GPUs per node)")
        if world % self.secondary:
            raise ValueError(f"hpZ secondary group of {self.secondary} ranks does not divide the world size {world}; "
                             "use a divisor of it (usually the GPUs per node)")
        return world // cut

    @property
    def name(self) -> str:
        parts = [f"tp={self.tp}"] if self.tp > 1 else []
        parts += [f"pp={self.pp}"] if self.pp > 1 else []
        parts += [f"replicas={self.replicas} (HSDP)"] if self.replicas > 1 else []
        parts += [f"hpZ k={self.secondary}"] if self.secondary > 1 else []
        parts += [f"sp={self.sp} (Ulysses)"] if self.sp > 1 else []
        parts += [f"ep={self.ep} (experts)"] if self.ep > 1 else []
        return ", ".join(parts) or "flat data parallel"


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Where the optimizer state and the 16-bit parameters live when not on the GPU."""

    optimizer: str = "none"
    """none | cpu | nvme: fp32 master, optimizer state and fp32 gradient shard leave the GPU."""
    params: str = "none"
    """none | cpu | nvme: the 16-bit parameter shard leaves the GPU (stage 3 only)."""

    def __post_init__(self) -> None:
        _choice("optimizer offload", self.optimizer, OFFLOAD_DEVICES)
        _choice("parameter offload", self.params, OFFLOAD_DEVICES)
        if self.params != "none" and self.optimizer == "none":
            raise ValueError("parameter offload needs optimizer offload too (ZeRO-Infinity steps the "
                             "optimizer where the parameters live); add optimizer offload")

    @property
    def any(self) -> bool:
        return self.optimizer != "none" or self.params != "none"

    @property
    def name(self) -> str:
        if not self.any:
            return "no offload"
        parts = [f"optimizer->{self.optimizer}"] + ([f"params->{self.params}"] if self.params != "none" else [])
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """The numbers a plan assumes rather than derives; each one is printed in the memo."""

    mfu: float = 0.40
    """Model FLOPs utilisation: achieved / peak tensor FLOPS (PaLM reports 46.2% on TPU v4,
    Chowdhery et al. 2022, Table 3; 35-50% is typical for dense transformers)."""
    bandwidth_efficiency: float = 0.80
    """Achieved / peak bandwidth of every link, PCIe, host memory and NVMe."""
    overhead_bytes: int = 1 * GB
    """Per-GPU allowance for the CUDA context, NCCL communicators and library workspaces (not measured)."""
    nvme_sub_group_elements: int = 10**9
    """DeepSpeed's `sub_group_size` default: optimizer elements staged in host RAM at a time (NVMe)."""
    nvme_param_buffer_elements: int = 5 * 10**8
    """DeepSpeed's offload_param buffer_count (5) x buffer_size (1e8): host staging for NVMe params."""
    optimizer_seconds_per_element: float | None = None
    """The optimizer step's time per owned element, measured (zerokit plan --measure-device) or given;
    None prices it as memory-bound at the device's bandwidth."""

    def __post_init__(self) -> None:
        _fraction("mfu", self.mfu, low=0.0, high=1.0, closed_high=True)
        _fraction("bandwidth efficiency", self.bandwidth_efficiency, low=0.0, high=1.0, closed_high=True)
        if self.mfu == 0 or self.bandwidth_efficiency == 0:
            raise ValueError("mfu and bandwidth efficiency must be > 0")
        if isinstance(self.overhead_bytes, bool) or not self.overhead_bytes >= 0:  # `not >=` rejects NaN too
            raise ValueError(f"overhead={self.overhead_bytes!r} bytes must be >= 0")
        seconds = self.optimizer_seconds_per_element
        if seconds is not None and not 0 < seconds < math.inf:
            raise ValueError(f"optimizer seconds per element={seconds!r} must be > 0 and finite")


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How the decision procedure may move (advice.py)."""

    headroom: float = 0.10
    """Fraction of GPU memory (and host RAM) left free: a plan fits if it uses at most (1 - headroom)."""
    checkpointing: str = "auto"
    """auto: turn on full activation checkpointing only if nothing fits without it; none | full: fixed."""
    offload: str = "auto"
    """auto: try CPU then NVMe offload if no stage fits on the GPU alone; none: never offload."""
    tensor: str = "auto"
    """auto: try a tensor degree inside the node before offloading (advice.py); none: flat layouts only."""
    sequence: str = "auto"
    """auto: try a sequence degree inside the node (Ulysses) before a tensor degree and offloading (advice.py);
    none: never."""
    expert: str = "auto"
    """auto: for a mixture-of-experts model, try an expert degree inside the node before the sequence and tensor
    degrees and offloading (advice.py); none: never."""
    max_micro_batch: int = 1024
    """Upper bound of the largest-micro-batch search."""

    def __post_init__(self) -> None:
        _fraction("headroom", self.headroom, low=0.0, high=1.0, closed_high=False)
        _choice("checkpointing policy", self.checkpointing, ("auto",) + CHECKPOINTING)
        _choice("offload policy", self.offload, ("auto", "none"))
        _choice("tensor policy", self.tensor, ("auto", "none"))
        _choice("sequence policy", self.sequence, ("auto", "none"))
        _choice("expert policy", self.expert, ("auto", "none"))
        _positive_int("max micro batch", self.max_micro_batch)
