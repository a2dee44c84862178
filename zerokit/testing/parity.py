"""Parity: train the same model with zerokit on N ranks and naively in one process; compare.

[Note: what the single-process reference computes]
The reference sees the union of the ranks' batches, in one process, with the same torch optimizer:
for every micro-step it runs each rank's batch through the model in turn (so a data-dependent branch
sees exactly the batch it saw on that rank), backpropagates `loss / accumulation`, adds each batch's
gradient into fp32 master gradients and divides their sum by N: the gradient of the mean loss over
the union. (Dividing by N after the 16-bit backward, not before, is also what the ranks do; it keeps
the comparison about distribution, not about where a 16-bit rounding happens.) It clips by the global
norm with torch's formula (squares summed in float64, as zerokit does) and, for fp16, uses DeepSpeed's
dynamic loss-scaling policy. A parameter that gets no gradient from any rank's batch in a whole
accumulation window keeps `.grad = None`, so the optimizer skips it, exactly as torch runs it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, replace

import torch

from zerokit.config.typed import DTYPES_BY_NAME, LossScaling, OptimizerSpec, load_config
from zerokit._support.extras import require
from zerokit.precision.scaler import make_loss_scaler
from zerokit.engine.schedules import build_optimizer
from zerokit.testing.models import TinyGPT, TinyGPTConfig, TinyMoE, lm_loss, param_groups, seeded_init


@dataclass(frozen=True)
class Case:
    name: str
    stage: int
    # tiny | moe | hf-gpt2 | hf-llama (Hugging Face transformers, built from a tiny config) | hf-llama-untied (its own
    # LM head, which tensor parallelism splits) | hf-llama-mha (untied, 4 key-value heads: a tensor degree of 4 fits)
    model: str = "tiny"
    dtype: str = "fp32"
    # adamw | adam | sgd | adafactor | muon+adamw (two optimizers) | adamw-block (as an `optimizer` block builds it)
    optimizer: str = "adamw"
    # tiny: who runs the sometimes-used layer. "rotating": rank r on steps where (step + micro + r) % 3 == 0;
    # "idle-or-rank0": nobody on even steps, rank 0 alone on odd ones (at any world size).
    # moe: "idle-or-rank0": experts 2-3 get no token on even steps anywhere, on odd steps none on rank 0 only.
    usage: str = "rotating"
    steps: int = 5
    accumulation: int = 1
    clip: float = 0.5
    bucket_bytes: int = 8192  # small, so the model spans many buckets
    reduce_every_micro_step: bool = True
    checkpoint: bool = False
    micro_batch: int = 2
    initial_scale_power: int = 16  # fp16 only
    min_unit_params: int = 1000  # stage 3: TinyGPT's blocks (~7k parameters each) become units
    persistence_threshold: int = 0  # stage 3: units smaller than this stay gathered
    max_live_parameters: int = 10**9  # stage 3
    n_layer: int = 2
    reuse_first_block: bool = False  # a module called twice in one forward
    reverse_on_odd_steps: bool = False  # stage 3: the block order changes from step to step (all ranks alike)
    freeze_matrices: bool = False  # an adapter-style fine-tune: only 1-D parameters (norms, biases) train
    freeze_norms: bool = False  # frozen LayerNorms: at stage 3 a block's ln_1 backward comes after its gradients
    frozen_blocks: tuple[int, ...] = ()  # blocks with every parameter frozen (at stage 3: units with no gradient)
    meta: bool = False  # stage 3: zerokit builds the model on the meta device and materialises it by unit
    sub_group_size: int | None = None  # the optimizer steps masters in pieces of this many elements
    reduce_scatter: bool | None = None  # stages 1-3: None is zerokit's default (on gloo: all-reduce, keep the shard)
    overlap_comm: bool = True  # False is sent in the JSON dict (at stage 3 it changes nothing: See ZeroConfig)
    unit_classes: tuple[str, ...] = ()  # stage 3: class names that become units (may nest), sent in the JSON dict
    # stage 3: modules that become units, by name in the model ("blocks.0.attn"): the case is pickled to
    # the ranks, so run_engine resolves the names to the model's own instances
    unit_modules: tuple[str, ...] = ()
    offload_optimizer: str = "none"  # none | cpu | nvme (stages 1-3)
    offload_ratio: float = 1.0  # the share of the optimizer stepped on the CPU (DeepSpeed's Twin-Flow ratio)
    offload_param: str = "none"  # none | cpu | nvme (stage 3)
    offload_max_in_cpu: int | None = None  # nvme parameters: elements kept in host memory (None: DeepSpeed's 1e9)
    checkpoint_units: bool = False  # stage 3: zerokit checkpoints every unit (activation_checkpointing block)
    cpu_checkpointing: bool = False  # checkpointed activations in host memory
    mics_shard_size: int = -1  # stages 1-3: MiCS shard groups of this many ranks (-1: one group over all)
    ranks_per_node: int | None = None  # None: torchrun's LOCAL_WORLD_SIZE, else one node
    hpz_partition_size: int = 1  # stage 3: ZeRO++ hpZ's secondary copy over groups of this many ranks (1: none)
    device: str = "cpu"  # where the batches and the reference live (the engine computes on default_device())


def make_model(case: Case) -> torch.nn.Module:
    torch.manual_seed(1234)
    if case.model == "moe":
        return TinyMoE()
    if case.model == "tiny":
        model = TinyGPT(TinyGPTConfig(checkpoint_blocks=case.checkpoint, n_layer=case.n_layer,
                                      reuse_first_block=case.reuse_first_block,
                                      reverse_on_marker=case.reverse_on_odd_steps))
        if case.meta:  # the same values zerokit's param_init gives the meta-built copy
            with torch.no_grad():
                init = seeded_init(model)
                for module in model.modules():
                    init(module)
        freeze(model, case)
        return model
    transformers = require("transformers", f"the parity case {case.model!r}")

    if case.model == "hf-gpt2":
        config = transformers.GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    if case.model in ("hf-llama", "hf-llama-untied", "hf-llama-mha"):
        tied = case.model == "hf-llama"
        # untied: 68 words, so that a tensor degree of 2 or 4 splits the LM head's outputs (the batches use 67)
        config = transformers.LlamaConfig(vocab_size=67 if tied else 68, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=4 if case.model == "hf-llama-mha" else 2,
                                          max_position_embeddings=16, tie_word_embeddings=tied, bos_token_id=0,
                                          eos_token_id=0)
        return transformers.LlamaForCausalLM(config)
    raise ValueError(f"unknown model {case.model!r}")


def freeze(model: torch.nn.Module, case: Case) -> None:
    """Freeze what the case asks for, on a TinyGPT built eagerly or on the meta device alike."""
    if case.freeze_matrices:
        for param in model.parameters():
            param.requires_grad_(param.dim() < 2)
    if case.freeze_norms:
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.requires_grad_(False)
    for index in case.frozen_blocks:
        model.blocks[index].requires_grad_(False)


def forward_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    output = model(tokens[:, :-1])
    return lm_loss(output if isinstance(output, torch.Tensor) else output.logits, tokens)


def make_optimizer(case: Case, model: torch.nn.Module) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    groups = param_groups(model, weight_decay=0.1)
    if case.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    if case.optimizer == "adam":
        return torch.optim.Adam(groups, lr=3e-3)
    if case.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if case.optimizer == "adamw-block":  # torch's fused AdamW (See [Note: fused optimizer kernels])
        spec = OptimizerSpec(type="AdamW", params={"lr": 3e-3, "betas": (0.9, 0.95)})
        return build_optimizer(spec, groups)[0]
    if case.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=1e-2)
    if case.optimizer == "muon+adamw":  # Muon for the hidden matrices, as its authors use it; AdamW for the rest
        hidden = [p for name, p in model.named_parameters() if p.dim() == 2 and _is_hidden(name)]
        rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
        return [torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.1),
                torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)]
    raise ValueError(f"unknown optimizer {case.optimizer!r}")


def _is_hidden(name: str) -> bool:
    """Not the embeddings or the output head (tied to the token embedding)."""
    return not any(part in name for part in ("wte", "wpe", "lm_head", "head"))


def optimizer_list(optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    return optimizer if isinstance(optimizer, list) else [optimizer]


def make_batch(case: Case, step: int, micro: int, rank: int, vocab: int = 67, block: int = 16) -> torch.Tensor:
    """(B, T+1) tokens for one rank's micro-step. The first token decides whether the model's
    sometimes-used layer runs (token % 3 == 0): it is set so ranks disagree on some steps."""
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    tokens = torch.randint(0, vocab, (case.micro_batch, block + 1), generator=generator)
    if case.model == "moe":
        return _route(tokens, step, rank, case.usage)
    if case.usage == "idle-or-rank0":
        tokens[0, 0] = 0 if step % 2 == 1 and rank == 0 else 1
    else:
        tokens[0, 0] = (step + micro + rank) % 3
    if case.reverse_on_odd_steps:  # the model's order marker: the same on every rank, odd steps reversed
        tokens[1, 0] = step % 2
    return tokens


def _route(tokens: torch.Tensor, step: int, rank: int, usage: str, experts: int = 4) -> torch.Tensor:
    """Tokens re-mapped so that only some experts of TinyMoE are chosen (expert = token % 4): see Case.usage."""
    if usage != "idle-or-rank0" or (step % 2 == 1 and rank != 0):
        return tokens
    allowed = 2 if step % 2 == 0 else 3  # even steps: experts 0-1 everywhere; odd: 0-2 on rank 0
    return tokens - tokens % experts + tokens % allowed


def engine_config(case: Case) -> dict:
    """DeepSpeed-style dict, so the parity tests exercise the config reader too."""
    config = {
        "zero_optimization": {"stage": case.stage, "reduce_bucket_bytes": case.bucket_bytes},
        "gradient_accumulation_steps": case.accumulation,
        "gradient_clipping": case.clip,
    }
    if case.stage == 2:
        config["zero_optimization"]["reduce_every_micro_step"] = case.reduce_every_micro_step
    if case.stage > 0 and case.reduce_scatter is not None:
        config["zero_optimization"]["reduce_scatter"] = case.reduce_scatter
    if case.sub_group_size is not None:
        config["zero_optimization"]["sub_group_size"] = case.sub_group_size
    if not case.overlap_comm:
        config["zero_optimization"]["overlap_comm"] = False
    if case.stage == 3:
        config["zero_optimization"].update({
            "stage3_min_unit_params": case.min_unit_params,
            "stage3_param_persistence_threshold": case.persistence_threshold,
            "stage3_max_live_parameters": case.max_live_parameters})
        if case.unit_classes:
            config["zero_optimization"]["stage3_unit_classes"] = list(case.unit_classes)
    for key, device in (("offload_optimizer", case.offload_optimizer), ("offload_param", case.offload_param)):
        if device != "none":
            block = config["zero_optimization"][key] = {"device": device}
            if device == "nvme":
                block["nvme_path"] = offload_dir()
            if key == "offload_optimizer" and case.offload_ratio < 1:
                block["ratio"] = case.offload_ratio
            if key == "offload_param" and case.offload_max_in_cpu is not None:
                block["max_in_cpu"] = case.offload_max_in_cpu
    if case.checkpoint_units or case.cpu_checkpointing:
        config["activation_checkpointing"] = {"cpu_checkpointing": case.cpu_checkpointing}
        if case.checkpoint_units:
            config["activation_checkpointing"]["checkpoint_units"] = True
    if case.mics_shard_size != -1:
        config["zero_optimization"]["mics_shard_size"] = case.mics_shard_size
    if case.hpz_partition_size != 1:
        config["zero_optimization"]["zero_hpz_partition_size"] = case.hpz_partition_size
    if case.ranks_per_node is not None:
        config["ranks_per_node"] = case.ranks_per_node
    if case.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if case.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": case.initial_scale_power, "hysteresis": 1}
    return config


def offload_dir() -> str:
    """Where NVMe-offload cases swap: a folder of this machine's disk (not a RAM-backed /tmp)."""
    import os
    import tempfile

    return os.environ.get("ZEROKIT_TEST_NVME_PATH", tempfile.gettempdir())


def fp32_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def run_engine(rank: int, world_size: int, case: Case) -> dict:
    """One rank's side of a parity case (call inside an initialised process group)."""
    import zerokit

    if case.meta:
        with torch.device("meta"):
            model = TinyGPT(TinyGPTConfig(n_layer=case.n_layer))
        freeze(model, case)
    else:
        model = make_model(case)
    config = load_config(engine_config(case))
    if case.unit_modules:  # instances exist only on the typed config: JSON carries class names
        units = tuple(model.get_submodule(name) for name in case.unit_modules)
        config = replace(config, stage3=replace(config.stage3, units=units))
    engine = zerokit.initialize(model, make_optimizer(case, model), config,
                                param_init=seeded_init(model) if case.meta else None)
    losses, results, comm_per_step, overlapped = [], [], [], []
    for step in range(case.steps):
        before = engine.comm_stats()
        for micro in range(case.accumulation):
            tokens = make_batch(case, step, micro, rank).to(case.device)
            loss = forward_loss(engine, tokens)
            engine.backward(loss)
            overlapped.append(engine.reducer.launched_in_backward)
            if step == case.steps - 1 and micro == case.accumulation - 1:
                at_boundary = engine.memory_stats()  # the gradients held from the last backward to its step
                tiers_at_boundary = engine.memory_by_tier()
            result = engine.step()
            losses.append(loss.item())
        results.append(asdict(result))
        after = engine.comm_stats()
        comm_per_step.append({kind: {k: after[kind][k] - before[kind][k] for k in after[kind]} for kind in after})
    out = {
        "case": asdict(case), "losses": losses, "results": results, "comm_per_step": comm_per_step,
        "params": {n: v for n, v in engine.full_state_dict().items() if n in dict(model.named_parameters())},
        "memory": engine.memory_stats(),
        "memory_at_boundary": at_boundary, "memory_by_tier_at_boundary": tiers_at_boundary,
        "memory_by_tier": engine.memory_by_tier(),
        "local_shard_numel": engine.stage.layout.shards_of(rank).numel if engine.config.stage > 0 else None,
        "layout_numel": engine.stage.layout.numel, "buckets": len(engine.stage.layout.buckets),
        "reduce_scatter": engine.stage.reduce_scatter,
        "optimizer_pieces": engine.stage.masters.piece_count,
        # elements of this rank's masters that are parameters, not padding: only they have optimizer state
        "stepped_numel": sum(ref.piece.numel() for ref in engine.stage.masters.piece_refs()),
        "trainable_numel": engine.trainable_numel(), "launched_in_backward": overlapped,
        "trainable_tensors": len(engine.stage.flat.params),
        "buffer_dtypes": len(engine.safeguards.buffers.groups),  # broadcast_buffers: one broadcast each per step
        "unit_numel": engine.stage.shards.unit_numel if engine.config.stage == 3 else None,
        "frozen_numel": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        **stage3_frozen_layout(engine.stage),
        "peak_live_numel": engine.stage.shards.peak_live_numel if engine.config.stage == 3 else None,
        "step_counts": engine_step_counts(engine, model),
        "owned_buckets": [(b.owner, b.numel) for b in engine.stage.layout.buckets if b.owner is not None],
    }
    # A sweep runs a hundred cases in one process: an engine left open keeps its process groups' gloo threads and
    # its heartbeat posting to the store twice a second, and by the sweep's end a rank of 3 on 2 cores spent half
    # its time in the kernel switching between ~300 such threads (the N=3 sweep took 71 s; See [Note: the suite's
    # time] in docs/testing.md).
    engine.close()
    return out


def engine_step_counts(engine, model: torch.nn.Module) -> dict[str, float]:
    """How many times each parameter this rank (partly) updates has been stepped, by name: the optimizer's
    own `step` state of its pieces (0 for a piece never stepped), for the optimizers that keep one."""
    counts, masters = {}, engine.stage.masters
    names = {i: slot.name for b in engine.stage.layout.buckets for slot in b.slots for i in [slot.param_index]}
    refs = masters.piece_refs()
    for index in range(len(masters)):
        with masters.resident(index):  # an NVMe-offloaded master's state is in memory only inside this
            for ref in refs:
                state = ref.optimizer.state.get(ref.piece, {})
                if state:
                    counts[names[ref.param_index]] = float(state["step"]) if "step" in state else 1.0
                else:
                    counts.setdefault(names[ref.param_index], 0.0)
    return counts


def reference_step_counts(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, float]:
    counts = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                name = next(n for n, p in model.named_parameters() if p is param)
                counts[name] = float(state["step"]) if "step" in state else (1.0 if state else 0.0)
    return counts


def stage3_frozen_layout(stage) -> dict:
    """Stage 3 shards frozen parameters per unit: each unit's gathered (padded) frozen elements, and
    this rank's shards of them all. Empty at other stages."""
    if stage.part.stage != 3:
        return {}
    frozen_of = stage.shards.frozen_of
    return {"unit_frozen_numel": [frozen_of[u.index].numel if u.index in frozen_of else 0 for u in stage.units],
            "frozen_shard_numel": stage.frozen.local.numel}


def run_reference(case: Case, world_size: int, ranks_per_step: list[int] | None = None) -> dict:
    """The same training in one process, naively. See [Note: what the single-process reference computes].
    `ranks_per_step`: how many ranks' batches make each step (default: world_size for each of case.steps; a
    resumed run on another world size changes it mid-run). Losses are (step, rank, loss), micro-steps in order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on each rank: CPU kernels may round differently with other thread counts
    try:
        return _run_reference(case, ranks_per_step or [world_size] * case.steps)
    finally:
        torch.set_num_threads(threads)


def _run_reference(case: Case, ranks_per_step: list[int]) -> dict:
    dtype = DTYPES_BY_NAME[case.dtype]
    master = make_model(case).to(case.device)
    optimizers = optimizer_list(make_optimizer(case, master))
    compute = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    pairs = [(m, c) for m, c in zip(master.parameters(), compute.parameters()) if m.requires_grad]
    scaler = make_loss_scaler(LossScaling(initial_scale_power=case.initial_scale_power, hysteresis=1)
                              if case.dtype == "fp16" else None)
    master_grads = [torch.zeros_like(m) for m, _ in pairs]
    losses, skipped, norms = [], [], []
    for step, ranks in enumerate(ranks_per_step):
        used = [False] * len(pairs)
        for micro in range(case.accumulation):
            for rank in range(ranks):
                tokens = make_batch(case, step, micro, rank).to(case.device)
                loss = forward_loss(compute, tokens)
                (loss * scaler.scale / case.accumulation).backward()
                losses.append((step, rank, loss.item()))
                for index, (grad, (_, c)) in enumerate(zip(master_grads, pairs)):
                    if c.grad is not None:
                        grad += c.grad.float()
                        c.grad = None
                        used[index] = True
        for grad, (m, _), got in zip(master_grads, pairs, used):
            m.grad = grad / ranks / scaler.scale if got else None  # the mean over the union's N batches
        norms.append(math.sqrt(sum(m.grad.double().square().sum().item() for m, _ in pairs if m.grad is not None)))
        skipped.append(clip_and_step(pairs, case, scaler, optimizers))
        for grad, (m, _) in zip(master_grads, pairs):
            grad.zero_()
            m.grad = None  # in fp32 the master is the compute parameter: start the next step clean
        if compute is not master:
            with torch.no_grad():
                for m, c in pairs:
                    c.copy_(m)
    return {"losses": losses, "skipped": skipped, "norms": norms, "params": fp32_state(compute),
            "master": fp32_state(master),
            "step_counts": reference_step_counts(master, optimizers)}


def clip_and_step(pairs, case: Case, scaler, optimizers: list[torch.optim.Optimizer]) -> bool:
    """The reference's step once the masters hold their averaged, unscaled gradients: the global norm (naively,
    in float64), clip, the loss scaler's update, then every optimizer unless the step overflowed. Returns
    whether it overflowed (a skipped step)."""
    grads = [m.grad for m, _ in pairs if m.grad is not None]
    norm = math.sqrt(sum(g.double().square().sum().item() for g in grads))
    overflow = not math.isfinite(norm)
    if case.clip > 0 and not overflow and case.clip / (norm + 1e-6) < 1:
        torch._foreach_mul_(grads, case.clip / (norm + 1e-6))
    scaler.update(overflow)
    if not overflow:
        for optimizer in optimizers:
            optimizer.step()
    return overflow


def run_cases(rank: int, world_size: int, cases: list[Case]) -> dict[str, dict]:
    """Every case on this rank, one after another: one spawn serves a whole sweep."""
    return {case.name: run_engine(rank, world_size, case) for case in cases}
