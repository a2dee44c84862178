"""Bytes per rank, by the engine's categories (`engine.memory_stats()`): parameters, gradients,
optimizer_state; plus activations, buffers and overhead, which only the planner predicts.

[Note: bytes per parameter]
Mixed precision (bf16/fp16) keeps 16-bit parameters and gradients and an fp32 master copy that the
optimizer updates; the master is counted as optimizer state (ZeRO paper, Rajbhandari et al. 2019,
Section 3.1: "2Psi + 2Psi + K Psi" with K = 12 for mixed-precision Adam). Per trainable parameter:

    optimizer      mixed precision (K)              fp32 (K)
    adam / adamw   12 = 4 master + 4 m + 4 v        8 = 4 m + 4 v (the parameter is the master)
    sgd-momentum    8 = 4 master + 4 momentum       4 = 4 momentum
    sgd             4 = 4 master                    0
    muon            8 = 4 master + 4 momentum       4 = 4 momentum  (the blocks' matrices; AdamW's 12 or 8
                                                                     for the rest: See below)
    adafactor       4 = 4 master                    0               (+ 4 (rows + columns) per matrix)

[Note: whole-tensor optimizers]
torch.optim.Muon orthogonalises each matrix's update and torch.optim.Adafactor factors each matrix's second
moment into a row and a column vector, so neither can step a flat shard: the engine gives each rank whole
parameters, balanced by size, reduces their gradients to the owner and broadcasts the updated tensors from it
(zerokit/flat/layout.py, [Note: buckets owned by one rank]). Memory per rank is the same K x Psi / N on
average (a rank may hold up to one largest matrix more); traffic is the same bytes, in reduce and broadcast
calls instead of reduce-scatter and all-gather (and, at stage 3, broadcasts instead of the gathers of those
parameters). Muon is used on the 2-D hidden matrices only, with AdamW on the embeddings, the head and the
norms: the planner counts the blocks' parameters under Muon and the rest (the root unit's) under AdamW.
Adafactor keeps no first moment by default and its factored second moment, (rows + columns) x 4 bytes a
matrix, is under 1% of the matrix for any hidden size over 800: K counts the master alone.
Frozen parameters (LoRA base, a trainable fraction < 1) cost only their 16-bit (or fp32) copy.
Stage s shards, over the N_d ranks of the ZeRO group: s >= 1 optimizer state, s >= 2 gradients,
s = 3 parameters (frozen ones too). Sharded gradients are the reduced shards, which zerokit keeps in
the reduce dtype (fp32 by default, `communication_data_type`): 4 bytes, or the paper's 2 with a 16-bit
reduce dtype. Unsharded gradients (stages 0-1) are in the compute dtype.

[Note: activation accounting]
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Section 4:
one GPT block stores s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations and no recomputation, made of
LayerNorm inputs 4sbh, attention 11sbh + 5as^2b (QKV input 2, Q and K 4, V 2, projection input 2,
dropout mask 1; softmax 2as^2b, its dropout mask as^2b and output 2as^2b), MLP 19sbh (input 2,
GELU input 8, GELU output 8, dropout mask 1), with e = 2 bytes per element and 1 byte per mask. We
generalise the same term-by-term count: e*(q + 2kv) for Q, K, V under grouped-query attention, 4e*f
for a SwiGLU MLP (gate input, SiLU output, up output, product), no masks without dropout, and for
fused (flash) attention no s x s term but its fp32 log-sum-exp, 4*a*s*b bytes; each LoRA adapter adds
its rank-r intermediate, e*r per token. The logits for the loss are 4*s*b*v bytes in fp32, plus
2e*s*b*h for the final norm and head inputs (Section 4.3).
Full checkpointing stores only each block's input, e*s*b*h per layer (Korthikanti Table 2: 2sbhL),
and we add one block's full activations, live while that block is recomputed and back-propagated.
Tensor parallelism divides everything by t (sequence parallelism assumed, Section 4.2.2); 1F1B
pipelining keeps min(p, m) micro-batches of L/p layers in flight on the first stage (Section 4.2.3).

[Note: the expert degree]
A mixture-of-experts model's routed experts (E per MoE layer, Psi_E of its Psi parameters) split over the ep ranks of
an expert group; the rest (attention, norms, router, shared experts, embeddings: Psi - Psi_E, "dense") is held as
in a dense model. The layout (spec.Layout.ep, [Note: the expert dimension] in zerokit/parallel/mesh.py) puts every
expert on data / ep ranks, its expert-data group, and ZeRO shards each part over the ranks that hold it:
    dense    over all N_d ranks, as without experts
    experts  a rank holds Psi_E / ep (E / ep experts whole) and shards them over N_d / ep ranks:
             stage 0 nothing, stage 1 their optimizer state, stage 2 their gradients too, stage 3 their parameters
So the sharded categories are Psi_E / ep / (N_d / ep) = Psi_E / N_d per rank, as flat ZeRO gives: an expert degree
saves only what a stage leaves whole (the parameters at stages 0-2, the gradients at 0-1, all at 0), and at stage 3
the gather unit, one MoE block, holds E / ep experts instead of E (buffer_bytes). Each part is priced by the same
model_states with its own shard group (`parts`). Activations do not change with ep: a rank still runs its own
tokens' attention, and on average top-k x capacity x its tokens through the experts, wherever they live; each
routed token keeps its copy of the input and output of the expert (2 e h), the expert's gated intermediates (4 e f_E),
and each token the router's fp32 probabilities (4 E), besides any shared expert's intermediates. Under LoRA the
experts are frozen (the adapters sit on the dense shapes); a trainable fraction applies to both parts alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerokit.config.defaults import MAX_BUCKETS_IN_FLIGHT, STAGE3_PARAM_PERSISTENCE_THRESHOLD
from zerokit.planner.calibration import Calibration
from zerokit.planner.models import Architecture, ModelSpec, ParamCounts
from zerokit.planner.spec import WHOLE_TENSOR_OPTIMIZERS, Assumptions, Layout, Offload, Training

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "buffers", "overhead")
ENGINE_CATEGORIES = CATEGORIES[:3]

# K of [Note: bytes per parameter], indexed (optimizer, mixed precision?).
OPTIMIZER_STATE_BYTES = {
    ("adamw", True): 12, ("adam", True): 12, ("sgd-momentum", True): 8, ("sgd", True): 4,
    ("adamw", False): 8, ("adam", False): 8, ("sgd-momentum", False): 4, ("sgd", False): 0,
    ("muon", True): 8, ("muon", False): 4, ("adafactor", True): 4, ("adafactor", False): 0,
}
MUON_COMPANION = "adamw"  # steps what Muon does not: embeddings, head, norms (the root unit's parameters)
IN_FLIGHT_BUCKETS = MAX_BUCKETS_IN_FLIGHT + 1  # the engine's BucketReducer: see zerokit/config/defaults.py


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU at the peak of a step (the sum of categories, which is conservative)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    buffers: int
    overhead: int

    @property
    def total(self) -> int:
        return sum(self.as_dict().values())

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in CATEGORIES}

    def engine_dict(self) -> dict[str, int]:
        """The keys and units of `engine.memory_stats()`, to compare a plan with a run."""
        return {name: getattr(self, name) for name in ENGINE_CATEGORIES}


@dataclass(frozen=True)
class RankParams:
    """What one rank holds before ZeRO shards it (tensor/pipeline parallelism already applied)."""

    total: int
    trainable: int
    unit: int
    """Parameters of one stage-3 unit (a transformer block) on this rank; 0 = unknown."""
    root: int
    """Parameters outside the blocks (embeddings, final norm, head), which stage 3 keeps gathered."""
    shard: int
    """N_d, the ZeRO shard group size."""
    experts: int = 0
    """Of `total`, the routed experts' parameters this rank holds: E / ep experts of every MoE layer."""
    expert_trainable: int = 0
    """Of `trainable`, the experts'."""
    ep: int = 1
    """The expert degree: the experts shard over shard / ep ranks (See [Note: the expert degree])."""


def rank_params(counts: ParamCounts, model: ModelSpec, layout: Layout, shard: int,
                threshold: int = STAGE3_PARAM_PERSISTENCE_THRESHOLD) -> RankParams:
    """Tensor and pipeline parallelism split every parameter evenly (an approximation for the
    embedding and head, which sit on the first and last pipeline stage). A block's parameters under
    `threshold` elements belong to the root unit, as the engine gives them at stage 3. An expert degree keeps
    E / ep of each MoE layer's experts on the rank (See [Note: the expert degree])."""
    split, arch, ep = layout.tp * layout.pp, model.architecture, layout.ep
    held = arch.experts.count // ep if arch and arch.experts else None  # a block's experts on this rank
    small = arch.small_block_params(threshold, held) if arch else 0
    unit = math.ceil((arch.block_params(held) - small) / layout.tp) if arch else 0
    root = math.ceil((arch.root_params() + arch.n_layers * small) / layout.tp) if arch else 0
    routed = arch.routed_expert_params() if arch else 0
    experts = math.ceil(routed / split / ep)
    # LoRA's adapters (counted beyond the model's own parameters) sit on the dense shapes: the experts stay frozen
    share = 0.0 if counts.total != model.total_params else counts.trainable / counts.total
    expert_trainable = round(experts * share)
    away = math.ceil(routed / split) - experts  # held by the other ranks of the expert group
    return RankParams(total=math.ceil(counts.total / split) - away,
                      trainable=math.ceil(counts.trainable / split) - round(away * share), unit=unit, root=root,
                      shard=shard, experts=experts, expert_trainable=expert_trainable, ep=ep)


def parts(rank: RankParams) -> tuple[RankParams, ...]:
    """The rank's parameters by the group that shards them: all over N_d; with an expert degree, the dense part over
    N_d and the experts over their expert-data group of N_d / ep (See [Note: the expert degree])."""
    if rank.ep == 1 or rank.experts == 0:
        return (rank,)
    dense = RankParams(total=rank.total - rank.experts, trainable=rank.trainable - rank.expert_trainable,
                       unit=rank.unit, root=rank.root, shard=rank.shard)
    experts = RankParams(total=rank.experts, trainable=rank.expert_trainable, unit=0, root=0,
                         shard=rank.shard // rank.ep)
    return dense, experts


def owned_trainable(rank: RankParams, stage: int = 1) -> int:
    """Trainable elements whose optimizer state this rank holds: its shard of each part (all of them at stage 0)."""
    return sum(math.ceil(part.trainable / part.shard) if stage >= 1 else part.trainable for part in parts(rank))


def owned_params(rank: RankParams) -> int:
    """This rank's shard of every parameter (stage 3, or offloaded parameters)."""
    return sum(math.ceil(part.total / part.shard) for part in parts(rank))


def optimizer_state_bytes(training: Training) -> int:
    """K: optimizer-state bytes per trainable parameter, fp32 master included (mixed precision)."""
    return OPTIMIZER_STATE_BYTES[(training.optimizer, training.mixed)]


def whole_tensor_fraction(rank: RankParams, training: Training) -> float:
    """The part of the trainable parameters a whole-tensor optimizer steps (See [Note: whole-tensor
    optimizers]): all of them for Adafactor, the blocks' for Muon (all when the architecture is unknown)."""
    if training.optimizer not in WHOLE_TENSOR_OPTIMIZERS:
        return 0.0
    if training.optimizer == "muon" and rank.total and (rank.root or rank.unit):
        return (rank.total - rank.root) / rank.total
    return 1.0


def broadcast_gathered(rank: RankParams, training: Training) -> int:
    """Of the parameters stage 3 gathers, those broadcast from their owner instead (a whole-tensor optimizer's:
    Muon's blocks, Adafactor's all); they keep no hpZ secondary copy either."""
    whole = whole_tensor_fraction(rank, training)
    # Muon's part is the blocks' (the root stays AdamW's); Adafactor's is everything
    return rank.total - rank.root if training.optimizer == "muon" and whole < 1 else round(whole * rank.total)


def secondary_bytes(rank: RankParams, training: Training, layout: Layout, stage: int) -> int:
    """hpZ's secondary copy: this rank's 1/k of every gathered parameter (See [Note: hpZ's secondary copy] in
    zerokit/flat/sharded.py), held on the GPU from the first forward of a step to its optimizer step; the
    engine's memory_stats() counts it with the parameters (the ShardedFlat holds it)."""
    if stage != 3 or layout.secondary == 1:
        return 0
    return training.param_bytes * math.ceil((rank.total - broadcast_gathered(rank, training)) / layout.secondary)


def optimizer_state_total(rank: RankParams, training: Training, elements: int) -> int:
    """Optimizer-state bytes of `elements` trainable parameters (a shard, or all): K each, and for Muon the
    root's part at AdamW's K."""
    k = optimizer_state_bytes(training)
    if training.optimizer != "muon":
        return k * elements
    companion = OPTIMIZER_STATE_BYTES[(MUON_COMPANION, training.mixed)]
    muon = whole_tensor_fraction(rank, training)
    return math.ceil(elements * (muon * k + (1 - muon) * companion))


def gradients_sharded(stage: int, training: Training) -> bool:
    return training.reduces_every_micro_step(stage)


def gradients_on_host(stage: int, training: Training, offload: Offload) -> bool:
    """With the optimizer offloaded, each reduced gradient shard goes straight to the host
    (ZeRO-Offload); only where gradients are sharded as they are produced."""
    return offload.optimizer != "none" and gradients_sharded(stage, training)


def model_states(rank: RankParams, training: Training, stage: int, offload: Offload) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer_state) bytes on the GPU: each part sharded over its own group (See [Note:
    the expert degree])."""
    states = [part_states(part, training, stage, offload) for part in parts(rank)]
    return sum(s[0] for s in states), sum(s[1] for s in states), sum(s[2] for s in states)


def part_states(rank: RankParams, training: Training, stage: int, offload: Offload) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer_state) bytes of parameters sharded over rank.shard ranks."""
    n = rank.shard
    parameters = training.param_bytes * (math.ceil(rank.total / n) if stage == 3 else rank.total)
    if stage == 3 and training.mixed and not offload.any:  # the trainable shards are the fp32 masters
        parameters = training.param_bytes * math.ceil((rank.total - rank.trainable) / n)
    if offload.params != "none":
        parameters = 0
    shard_bytes = training.reduce_bytes * math.ceil(rank.trainable / n)
    if gradients_sharded(stage, training):
        gradients = shard_bytes
    else:  # stage 2 reducing once per step also keeps its reduced shards
        gradients = training.grad_bytes * rank.trainable + (shard_bytes if stage == 2 else 0)
        if stage < 2 and training.widened and offload.optimizer == "none":
            # the engine keeps each reduced bucket (stage 0) or shard (stage 1) in the reduce dtype from
            # backward until the step: at the backward peak both copies are held
            gradients += training.reduce_bytes * (rank.trainable if stage == 0 else math.ceil(rank.trainable / n))
    if gradients_on_host(stage, training, offload):
        gradients = 0
    optimizer = optimizer_state_total(rank, training, math.ceil(rank.trainable / n) if stage >= 1 else rank.trainable)
    if offload.optimizer != "none":
        optimizer = 0
    return parameters, gradients, optimizer


# --- activations --------------------------------------------------------------------------------

def block_activation_bytes(arch: Architecture, training: Training) -> int:
    """One block, one micro-batch, nothing recomputed. See [Note: activation accounting]."""
    e, h, f, a = training.act_bytes, arch.hidden, arch.ffn, arch.n_heads
    tokens, s = training.tokens_per_micro_batch, training.seq_len
    # norms, QKV in, Q K V, proj in, MLP in
    per_token = e * (2 * h + h + (arch.q_dim + 2 * arch.kv_dim) + arch.q_dim + h)
    per_token += 0 if training.tiles > 1 else mlp_activation_per_token(arch, training)  # tiled: recomputed
    per_token += 2 * h if arch.dropout else 0  # attention-output and MLP-output dropout masks
    lora = training.trainable
    if lora.lora_rank is not None:  # each adapter keeps its rank-r intermediate for B's gradient
        per_token += e * lora.lora_rank * len(lora.lora_targets)
    if training.attention == "flash":
        core = 4 * a * tokens  # fp32 log-sum-exp per head and token
    else:
        core = e * a * s * tokens + ((1 + e) * a * s * tokens if arch.dropout else 0)
    return tokens * per_token + core


def mlp_intermediate_per_token(arch: Architecture, training: Training, ffn: int | None = None) -> int:
    """The MLP's intermediates a token keeps for backward (gate, up, their product: 4f in a gated MLP; 2f else)."""
    ffn = arch.ffn if ffn is None else ffn
    return training.act_bytes * (4 * ffn if arch.gated_mlp else 2 * ffn)


def moe_activation_per_token(arch: Architecture, training: Training) -> float:
    """A mixture-of-experts MLP's saved bytes per token (See [Note: the expert degree]): top-k x capacity routed
    copies of its input and output and the expert's intermediates, the shared experts', the router's probabilities."""
    x, e = arch.experts, training.act_bytes
    routed = x.top_k * x.capacity * (2 * e * arch.hidden + mlp_intermediate_per_token(arch, training, x.ffn))
    shared = mlp_intermediate_per_token(arch, training, x.shared_ffn) if x.shared_ffn else 0
    return routed + shared + 4 * x.count


def mlp_activation_per_token(arch: Architecture, training: Training) -> int:
    """The MLP's bytes per token, averaged over the blocks where some are dense and the rest mixtures of experts."""
    if arch.experts is None:
        return mlp_intermediate_per_token(arch, training)
    dense = arch.experts.dense_layers * mlp_intermediate_per_token(arch, training)
    return math.ceil((dense + arch.moe_layers * moe_activation_per_token(arch, training)) / arch.n_layers)


def output_activation_bytes(arch: Architecture, training: Training) -> int:
    """Final norm and head inputs plus fp32 logits for the loss (Korthikanti Section 4.3); with a tiled loss, one
    slice's logits at a time."""
    tokens = training.tokens_per_micro_batch
    return tokens * 2 * training.act_bytes * arch.hidden + math.ceil(tokens * 4 * arch.vocab / training.tiles)


def tile_working_bytes(arch: Architecture, training: Training) -> int:
    """A tiled MLP's one slice of intermediates, alive while it is computed or recomputed (0 untiled)."""
    if training.tiles == 1:
        return 0
    return math.ceil(training.tokens_per_micro_batch * mlp_activation_per_token(arch, training) / training.tiles)


def activation_bytes(model: ModelSpec, training: Training, layout: Layout,
                     calibration: Calibration | None = None) -> int:
    """Peak activation bytes on the busiest rank; 0 when only a parameter count is known. A calibration
    replaces the per-block and outside counts by what the model measurably saves (calibration.py)."""
    arch = model.architecture
    if arch is None:
        return 0
    # each token's activations split over the tensor ranks, the tokens over the sequence ranks (Ulysses: each rank
    # also runs attention for 1 / sp of the heads over the whole sequence, the same share of the core's memory)
    t, p = layout.tp * layout.sp, layout.pp
    b, s = training.micro_batch, training.seq_len
    measured = calibration.block(b, s) if calibration else block_activation_bytes(arch, training)
    block = math.ceil(measured / t)
    tokens = training.tokens_per_micro_batch
    stored = block if training.checkpointing == "none" else math.ceil(training.act_bytes * tokens * arch.hidden / t)
    working = 0 if training.checkpointing == "none" else block  # the block being recomputed
    working += math.ceil(tile_working_bytes(arch, training) / t)
    layers = math.ceil(arch.n_layers / p)
    in_flight = min(p, training.grad_accum)
    embedding_mask = math.ceil(tokens * arch.hidden / t) if arch.dropout and calibration is None else 0
    output = math.ceil((calibration.outside(b, s) if calibration else output_activation_bytes(arch, training)) / t)
    first_stage = in_flight * (layers * stored + embedding_mask) + working
    last_stage = layers * stored + working + output + (embedding_mask if p == 1 else 0)
    return max(first_stage, last_stage)


# --- temporary buffers --------------------------------------------------------------------------

def buffer_bytes(rank: RankParams, training: Training, stage: int, held: bool = False) -> int:
    """Communication staging: gradient buckets (stages 0-2); for stage 3 the engine's design
    (zerokit/stages/stage3.py): the root stays gathered all step, at most two blocks are live (the
    one computing and the prefetched or not-yet-reduced one), the root's gradients are staged in the
    reduce dtype through backward, and up to three block buckets are staged or in flight. `held`: a pipeline
    stage's units gathered once and held through the step (stage3_gathering "step"): all of them live."""
    n = rank.shard
    if stage == 3:
        in_flight = IN_FLIGHT_BUCKETS if training.overlap_comm else 1
        live = (rank.total if held else rank.root + 2 * rank.unit) * training.param_bytes
        staged = (rank.root + in_flight * rank.unit) * training.reduce_bytes
        return live + staged
    bucket = min(training.bucket_bytes, rank.trainable * training.reduce_bytes)
    in_flight = IN_FLIGHT_BUCKETS if training.overlap_comm else 1
    if stage == 0:
        return 0  # in place, or into the reduce-dtype copy that the gradients category keeps until the step
    # each rank's reduce-scatter output shard; on gloo the bucket is all-reduced in place instead
    outputs = in_flight * math.ceil(bucket / n) if training.reduces_by_scatter else 0
    if stage == 1:
        return (in_flight * bucket if training.widened else 0) + outputs  # a reduce-dtype copy of each bucket
    return in_flight * bucket + outputs  # stage 2 stages every bucket before it is reduced


def memory_breakdown(model: ModelSpec, rank: RankParams, training: Training, layout: Layout, stage: int,
                     offload: Offload, assumptions: Assumptions,
                     calibration: Calibration | None = None) -> MemoryBreakdown:
    """With a calibration, overhead also holds the backward's measured transient peak above the saved
    activations (activation gradients, the logits' gradients: See [Note: extrapolating a calibration])."""
    parameters, gradients, optimizer = model_states(rank, training, stage, offload)
    parameters += secondary_bytes(rank, training, layout, stage)
    activations = activation_bytes(model, training, layout, calibration)
    transient = 0
    if calibration is not None and model.architecture is not None:
        b, s = training.micro_batch, training.seq_len
        peaks = calibration.phase_peaks(b, s, model.architecture.n_layers)
        transient = max(0, math.ceil((max(peaks.values()) - calibration.activations(b, s, model.architecture.n_layers))
                                     / (layout.tp * layout.sp)))
    return MemoryBreakdown(parameters=parameters, gradients=gradients, optimizer_state=optimizer,
                           activations=activations,
                           buffers=buffer_bytes(rank, training, stage, training.gathers_once_per_step(stage, layout)),
                           overhead=assumptions.overhead_bytes + transient)


# --- host RAM and NVMe per node -----------------------------------------------------------------

@dataclass(frozen=True)
class HostUsage:
    """What offload puts on each node (all its GPUs' shards together)."""

    ram: int
    nvme: int
    ram_capacity: int
    nvme_capacity: int
    usable_ram: int

    @property
    def fits(self) -> bool:
        return self.ram <= self.usable_ram and self.nvme <= self.nvme_capacity


def host_usage(rank: RankParams, training: Training, offload: Offload, gpus_per_node: int,
               ram_capacity: int, nvme_capacity: int, headroom: float, assumptions: Assumptions) -> HostUsage:
    """Optimizer offload keeps K bytes of optimizer state, a 4-byte fp32 gradient and a 16-bit
    parameter buffer per element of each rank's shard (DeepSpeed ZeRO-Offload); on NVMe the state
    moves to disk and one sub-group stays staged in RAM. Parameter offload keeps the 16-bit shard."""
    shard, param_shard = owned_trainable(rank), owned_params(rank)
    ram = nvme = 0
    if offload.optimizer != "none":
        ram += (4 + training.param_bytes) * shard
        if offload.optimizer == "cpu":
            ram += optimizer_state_total(rank, training, shard)
        else:
            nvme += optimizer_state_total(rank, training, shard)
            ram += optimizer_state_total(rank, training, min(shard, assumptions.nvme_sub_group_elements))
    if offload.params == "cpu":
        ram += training.param_bytes * param_shard
    elif offload.params == "nvme":
        nvme += training.param_bytes * param_shard
        ram += training.param_bytes * min(param_shard, assumptions.nvme_param_buffer_elements)
    return HostUsage(ram=ram * gpus_per_node, nvme=nvme * gpus_per_node, ram_capacity=ram_capacity,
                     nvme_capacity=nvme_capacity, usable_ram=int(ram_capacity * (1 - headroom)))
