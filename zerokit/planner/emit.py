"""Configs that implement a pick: zerokit's (DeepSpeed-style keys the engine reads), DeepSpeed's,
and FSDP2 code. What a target cannot express raises ValueError saying why and what to use instead.
Activation checkpointing is set in the model code for every target, so it comes back as a note."""

from __future__ import annotations

from dataclasses import dataclass

from zerokit.planner.estimate import Estimate
from zerokit.config.settings import bucket_numel

TARGETS = ("zerokit", "deepspeed", "fsdp")
DEFAULT_CLIPPING = 1.0  # a common choice (Hugging Face Trainer's max_grad_norm); not part of the plan
NVME_PATH = "/local_nvme"  # DeepSpeed's documentation example; replace with a local NVMe mount


@dataclass(frozen=True)
class Emitted:
    target: str
    config: dict | str
    """A JSON-able dict (zerokit, deepspeed) or Python source (fsdp)."""
    notes: tuple[str, ...]


def _data_parallel_only(result: Estimate, target: str) -> None:
    """A pipeline's config is the ZeRO config of each stage's data group (zerokit.pipeline, deepspeed.pipe: the stage
    count is the model code's); a tensor degree is the `tensor_parallel` block zerokit (ZeRO 0-3) and DeepSpeed's
    AutoTP training (ZeRO 0-2) read; FSDP with either stays in model code."""
    layout = result.scenario.layout
    if (layout.tp > 1 or layout.pp > 1 or layout.sp > 1 or layout.ep > 1) and target == "fsdp":
        raise ValueError(f"--emit fsdp writes data-parallel code; the layout {layout.name} is set up in model code "
                         "(torch's parallelize_module and pipelining): use --emit zerokit")
    if layout.tp > 1 and target == "deepspeed" and result.stage == 3:
        raise ValueError(f"DeepSpeed 0.19.8's AutoTP training takes ZeRO 0-2, not ZeRO-3 with tp={layout.tp}: use "
                         "--emit zerokit (zerokit trains tensor_parallel.autotp_size at ZeRO-3)")


def _tensor_block(result: Estimate, target: str = "zerokit") -> dict:
    """The mesh's keys: the tensor degree's block, the sequence degree's key, and the expert degree's: zerokit's
    `expert_parallel_size`, DeepSpeed 0.19.8's AutoEP block (`expert_parallel`, read by get_expert_parallel_config in
    deepspeed/runtime/config.py and parse_autoep_config in deepspeed/module_inject/auto_ep_config.py)."""
    t, sp, ep = result.scenario.layout.tp, result.scenario.layout.sp, result.scenario.layout.ep
    experts = ({"expert_parallel": {"enabled": True, "autoep_size": ep}} if target == "deepspeed"
               else {"expert_parallel_size": ep})
    return {**({"tensor_parallel": {"autotp_size": t}} if t > 1 else {}),
            **({"sequence_parallel_size": sp} if sp > 1 else {}), **(experts if ep > 1 else {})}


def _expert_note(result: Estimate, target: str) -> tuple[str, ...]:
    """The expert degree: where each target takes it."""
    ep = result.scenario.layout.ep
    if ep == 1 or target == "fsdp":
        return ()
    if target == "deepspeed":
        return (f"expert_parallel.autoep_size={ep} is DeepSpeed 0.19.8's AutoEP: at initialize it replaces the Hugging "
                "Face model's MoE layers by expert-parallel ones (expert_parallel.preset_model may name the family: "
                "mixtral, qwen3_moe, deepseek_v2, deepseek_v3, ...; otherwise it detects them); a model built on "
                f"deepspeed.moe.layer.MoE takes ep_size={ep} in model code instead, which no config key sets",)
    return (f"expert_parallel_size={ep} splits each MoE layer's experts over {ep} consecutive ranks of a node "
            "(zerokit.parallel.experts: ExpertParallelMoE with expert_parallel_group(ep)); ZeRO shards the experts "
            f"over their expert-data group of {result.scenario.shard // ep} ranks",)


def _notes(result: Estimate, target: str) -> tuple[str, ...]:
    notes = list(_hybrid_notes(result, target)) + list(_expert_note(result, target))
    pp = result.scenario.layout.pp
    if pp > 1:
        gathering = (f', stage3_gathering="{result.training.stage3_gathering}"' if result.stage == 3 and target ==
                     "zerokit" else "")
        notes.append(f"pipeline of {pp} stages, gradient_accumulation_steps = micro-batches per step: "
                     "zerokit.pipeline.initialize(stage_module, optimizer, config, "
                     f"Layout.resolve(world, pipeline={pp})"
                     f"{gathering}) or deepspeed.pipe.PipelineModule(layers, num_stages={pp}) with zerokit.deepspeed")
    tp = result.scenario.layout.tp
    if tp > 1 and target != "fsdp":
        notes.append(f"tensor_parallel.autotp_size={tp} splits the model by its Hugging Face tp_plan over {tp} "
                     "consecutive ranks of a node; the batch sizes count every rank, tensor ranks included, as "
                     "DeepSpeed's AutoTP does (docs/tensor_parallel.md)")
    sp = result.scenario.layout.sp
    if sp > 1 and target != "fsdp":
        notes.append(f"sequence_parallel_size={sp} splits each sequence over {sp} consecutive ranks (Ulysses): feed "
                     "each rank engine.sequence.shard(batch) and combine with engine.sequence.loss, or run DeepSpeed's "
                     "ALST script on zerokit.deepspeed (docs/sequence_parallel.md)")
    if result.training.tiles > 1:
        notes.append(f"tiled MLP and loss over {result.training.tiles} slices are set in code, not the config "
                     "(zerokit.parallel.sequence.tiling)")
    if result.training.checkpointing == "full":
        notes.append("activation checkpointing is not a config key: wrap each transformer block, e.g. "
                     "model.gradient_checkpointing_enable() (Hugging Face) or torch.utils.checkpoint "
                     "(use_reentrant=False)")
    if result.offload.optimizer == "nvme" or result.offload.params == "nvme":
        notes.append(f"nvme_path is set to {NVME_PATH}: point it at a local NVMe mount")
    return tuple(notes)


def _hybrid_notes(result: Estimate, target: str) -> tuple[str, ...]:
    layout, hybrid = result.scenario.layout, result.hybrid
    if hybrid == "mics" and target == "deepspeed":
        return ("DeepSpeed 0.19.8 removed MiCS: its config check (_reject_removed_config_keys in "
                "deepspeed/runtime/config.py) raises DeepSpeedConfigError on zero_optimization.mics_shard_size, so "
                "this config starts only under zerokit's drop-in (`import zerokit.deepspeed as deepspeed`), which "
                "trains MiCS with DeepSpeed's meaning at stages 1-3; DeepSpeed's own MiCS (before 0.19.8) was "
                "stage 3 only",)
    if hybrid and target == "zerokit":
        return (f"ranks_per_node={result.scenario.cluster.gpus_per_node} names the nodes for launchers that do not "
                "set LOCAL_WORLD_SIZE (torchrun does; all ranks must agree)",)
    if hybrid == "hpz" and target == "fsdp":
        return (f"FSDP2's reshard_after_forward={layout.secondary} keeps a {layout.secondary}-rank copy from each "
                "forward to its backward only: every micro-step's forward gathers over all ranks again, where hpZ "
                "gathers over all ranks once per optimizer step",)
    if hybrid == "mics" and target == "fsdp":
        return (f"HSDP all-reduces gradients across the {layout.replicas} replicas every micro-step unless "
                "set_requires_gradient_sync(False) holds them until the last (written below); MiCS does so once "
                "per step",) if result.training.grad_accum > 1 else ()
    return ()


def _hybrid_keys(result: Estimate, ranks_per_node: bool) -> tuple[dict, dict]:
    """(zero_optimization keys, top-level keys) of MiCS (`mics_shard_size`) or hpZ (`zero_hpz_partition_size`)."""
    layout, scenario, hybrid = result.scenario.layout, result.scenario, result.hybrid
    zero = ({"mics_shard_size": scenario.shard} if hybrid == "mics"
            else {"zero_hpz_partition_size": layout.secondary} if hybrid == "hpz" else {})
    top = {"ranks_per_node": scenario.cluster.gpus_per_node} if zero and ranks_per_node else {}
    return zero, top


def _precision(result: Estimate) -> dict:
    precision = result.training.precision
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0}}  # 0 = dynamic loss scaling
    return {}


def _offload_blocks(result: Estimate, extra: dict) -> dict:
    blocks = {}
    for key, device in (("offload_optimizer", result.offload.optimizer), ("offload_param", result.offload.params)):
        if device != "none":
            blocks[key] = {"device": device, **extra, **({"nvme_path": NVME_PATH} if device == "nvme" else {})}
    return blocks


def _common(result: Estimate, clipping: float) -> dict:
    t = result.training
    return {"train_micro_batch_size_per_gpu": t.micro_batch, "gradient_accumulation_steps": t.grad_accum,
            "gradient_clipping": clipping, **_precision(result), "communication_data_type": t.reduce_dtype}


def emit_zerokit(result: Estimate, clipping: float = DEFAULT_CLIPPING) -> dict:
    """The keys zerokit's engine reads (zerokit/config/typed.py), DeepSpeed-style: sizes in elements."""
    _data_parallel_only(result, "zerokit")
    t = result.training
    zero = {"stage": result.stage, "reduce_bucket_size": bucket_numel(t.bucket_bytes, t.reduce_bytes),
            "overlap_comm": t.overlap_comm}
    if result.stage == 2 and not t.reduce_every_micro_step:
        zero["reduce_every_micro_step"] = False
    hybrid, top = _hybrid_keys(result, ranks_per_node=True)
    zero.update(hybrid)
    zero.update(_stage3_limits(result))
    zero.update(_offload_blocks(result, {"pin_memory": True}))
    return {**_common(result, clipping), **top, **_tensor_block(result), "zero_optimization": zero}


def _stage3_limits(result: Estimate) -> dict:
    """Let one block be prefetched and hold exactly what the plan counts live: the root and two blocks
    (see memory.buffer_bytes). DeepSpeed's defaults (5e7 prefetch, 1e9 live) would stop a 317M-parameter
    block from being prefetched, and a 70B model from being gathered at all."""
    rank = result.scenario.rank
    if result.stage != 3 or not rank.unit:
        return {}
    # the engine pads each of a unit's buckets (one per param group; two with the usual decay split) to a
    # multiple of the world size, and counts the padding live: allow it, or the start-up check could fail
    unit, root = rank.unit + 2 * rank.shard, rank.root + 2 * rank.shard
    return {"stage3_prefetch_bucket_size": unit, "stage3_max_live_parameters": root + 2 * unit}


def emit_deepspeed(result: Estimate, clipping: float = DEFAULT_CLIPPING) -> dict:
    """DeepSpeed's keys; MiCS's `mics_shard_size` as well, which only zerokit's drop-in still reads (a note)."""
    _data_parallel_only(result, "deepspeed")
    t = result.training
    zero = {"stage": result.stage, "overlap_comm": t.overlap_comm, "contiguous_gradients": True,
            "reduce_bucket_size": bucket_numel(t.bucket_bytes, t.reduce_bytes)}
    zero.update(_hybrid_keys(result, ranks_per_node=False)[0])
    zero.update(_stage3_limits(result))
    zero.update(_offload_blocks(result, {"pin_memory": True}))
    return {**_common(result, clipping), **_tensor_block(result, "deepspeed"), "zero_optimization": zero}


_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def _fsdp_stage_line(result: Estimate) -> tuple[str, str]:
    """(reshard_after_forward, comment) for stages 2 and 3; hpZ's k is FSDP2's int form."""
    k = result.scenario.layout.secondary
    if result.stage == 3 and k > 1:
        return str(k), (f"ZeRO-3 + hpZ: after forward each block is resharded to groups of {k} ranks, so the "
                        "backward gathers inside the node")
    if result.stage == 3:
        return "True", "ZeRO-3: parameters freed after forward, gathered again for backward"
    return "False", "ZeRO-2: parameters stay gathered from forward to backward; gradients are sharded"


def emit_fsdp(result: Estimate, clipping: float = DEFAULT_CLIPPING) -> str:
    """FSDP2 (`fully_shard`) code; stage 0 is DDP and stage 1 torch's ZeroRedundancyOptimizer."""
    _data_parallel_only(result, "fsdp")
    t, offload, layout = result.training, result.offload, result.scenario.layout
    if offload.optimizer == "nvme" or offload.params == "nvme":
        raise ValueError("FSDP has no NVMe offload; use --emit deepspeed (ZeRO-Infinity)")
    if offload.optimizer != "none" and offload.params == "none":
        raise ValueError("FSDP2 cannot offload only the optimizer: CPUOffloadPolicy moves parameters, gradients "
                         "and optimizer state together (pytorch PR #120256); use --emit deepspeed or zerokit")
    if result.stage in (0, 1) and layout.replicas > 1:
        raise ValueError("torch has no hybrid ZeRO-1: ZeroRedundancyOptimizer shards over every rank; use --emit "
                         "zerokit (mics_shard_size at stage 1)")
    if result.stage in (0, 1):
        return _ddp_code(result, clipping)
    if layout.secondary >= result.scenario.shard:
        raise ValueError(f"FSDP2's reshard_after_forward={layout.secondary} must be a divisor of the "
                         f"{result.scenario.shard} sharding ranks other than 1 and {result.scenario.shard}; "
                         "use a smaller secondary group, or --emit zerokit")
    shard = result.scenario.shard
    mesh = (f'init_device_mesh("cuda", ({layout.replicas}, {shard}), mesh_dim_names=("replicate", "shard"))'
            if layout.replicas > 1 else f'init_device_mesh("cuda", ({shard},))')
    reshard, comment = _fsdp_stage_line(result)
    extra = ", offload_policy=CPUOffloadPolicy(pin_memory=True)" if offload.any else ""
    policies = "CPUOffloadPolicy, MixedPrecisionPolicy" if offload.any else "MixedPrecisionPolicy"
    lines = ["import torch", "from torch.distributed.device_mesh import init_device_mesh",
             f"from torch.distributed.fsdp import {policies}, fully_shard", "",
             f"mesh = {mesh}" + ("  # HSDP: replicate x shard" if layout.replicas > 1 else ""),
             f"mp = MixedPrecisionPolicy(param_dtype={_TORCH_DTYPE[t.precision]}, "
             f"reduce_dtype={_TORCH_DTYPE[t.reduce_dtype]})",
             f"# {comment}", "for index, block in enumerate(model.layers):  # one unit per transformer block"]
    if t.checkpointing == "full":
        lines[3:3] = ["from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper"]
        lines += ["    block = model.layers[index] = checkpoint_wrapper(block)  # full activation checkpointing"]
    lines += [f"    fully_shard(block, mesh=mesh, reshard_after_forward={reshard}, mp_policy=mp{extra})",
              f"fully_shard(model, mesh=mesh, reshard_after_forward={reshard}, mp_policy=mp{extra})",
              f"optimizer = torch.optim.{_optimizer_class(t.optimizer)}(model.parameters())  # your hyperparameters",
              f"# per micro-step: model.set_requires_gradient_sync(micro_step == {t.grad_accum - 1}), "
              f"the last of {t.grad_accum}; loss.backward()",
              f"# per step: torch.nn.utils.clip_grad_norm_(model.parameters(), {clipping}); optimizer.step()"]
    return "\n".join(lines) + "\n"


def _optimizer_class(name: str) -> str:
    return {"adamw": "AdamW", "adam": "Adam"}.get(name, "SGD")


def _ddp_code(result: Estimate, clipping: float) -> str:
    t = result.training
    if result.offload.any:
        raise ValueError("torch's ZeroRedundancyOptimizer cannot offload; use --emit deepspeed or zerokit")
    opt = _optimizer_class(t.optimizer)
    lines = ["import torch", "from torch.nn.parallel import DistributedDataParallel as DDP", ""]
    if result.stage == 1:
        lines += ["from torch.distributed.optim import ZeroRedundancyOptimizer", "",
                  "# ZeRO-1 has no FSDP form; torch's ZeroRedundancyOptimizer shards optimizer state over DDP",
                  "# (it all-reduces gradients and broadcasts parameters: ~3 Psi per step, not ZeRO's 2 Psi)"]
    else:
        lines += ["# ZeRO-0 is plain data parallelism (FSDP1 NO_SHARD; FSDP2 has no NO_SHARD)"]
    lines.append("model = DDP(model)")
    if t.precision != "fp32":
        lines.append(f"# run forward under torch.autocast('cuda', dtype={_TORCH_DTYPE[t.precision]}); "
                     "keep fp32 parameters")
    if result.stage == 1:
        lines.append(f"optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.{opt})")
    else:
        lines.append(f"optimizer = torch.optim.{opt}(model.parameters())  # your hyperparameters")
    lines += [f"# accumulate {t.grad_accum} micro-steps under model.no_sync() except the last",
              f"# per step: torch.nn.utils.clip_grad_norm_(model.parameters(), {clipping}); optimizer.step()"]
    return "\n".join(lines) + "\n"


def emit(result: Estimate, target: str, clipping: float = DEFAULT_CLIPPING) -> Emitted:
    if target not in TARGETS:
        raise ValueError(f"emit target {target!r} is not accepted; use one of {', '.join(TARGETS)}")
    if isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or not clipping >= 0:
        raise ValueError(f"gradient clipping={clipping!r} must be >= 0 "
                         "(0 disables clipping, as in zerokit/config/typed.py)")
    writer = {"zerokit": emit_zerokit, "deepspeed": emit_deepspeed, "fsdp": emit_fsdp}[target]
    return Emitted(target, writer(result, clipping), _notes(result, target))
