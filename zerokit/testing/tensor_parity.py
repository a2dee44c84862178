"""Parity under tensor parallelism: a parity case (parity.py) trained on a layout of tensor x data ranks, the model
split by AutoTP's plan (config `tensor_parallel.autotp_size`), against one process on the union of the replicas'
batches (parity.run_reference with the replica count as its world size). The ranks of a tensor group read their
replica's batch, as DeepSpeed's AutoTP requires."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, replace

from pathlib import Path

import torch

from zerokit.parallel.mesh import Layout
from zerokit.testing.pipeline import consolidated_as_loaded
from zerokit.testing.parity import Case, engine_config, forward_loss, make_batch, make_model, make_optimizer


AUTOTP_CASE = Case("ds-autotp", stage=2, model="hf-llama-untied", steps=3, clip=0.05, accumulation=2)
"""What tests/scripts/ds_autotp.py trains under DeepSpeed and the drop-in alike: DeepSpeed's AutoTP + ZeRO-2, with
clipping and accumulation."""


def tensor_config(case: Case, tensor: int) -> dict:
    """The case's DeepSpeed-style dict with the tensor block and the micro-batch, as DeepSpeed's AutoTP configs
    give them (train_batch_size is then derived over every rank: See [Note: batch sizes under AutoTP count the
    tensor ranks])."""
    return {**engine_config(case), "tensor_parallel": {"autotp_size": tensor},
            "train_micro_batch_size_per_gpu": case.micro_batch}


def deepspeed_config(case: Case, tensor: int) -> dict:
    """The case as a config DeepSpeed 0.19.8 itself reads (no zerokit keys): for the drop-in and for DeepSpeed."""
    return {"train_micro_batch_size_per_gpu": case.micro_batch, "gradient_accumulation_steps": case.accumulation,
            "gradient_clipping": case.clip, "zero_optimization": {"stage": case.stage},
            "tensor_parallel": {"autotp_size": tensor}, "zero_allow_untested_optimizer": True,
            **({"bf16": {"enabled": True}} if case.dtype == "bf16" else {})}


def start_engine(model: torch.nn.Module, case: Case, tensor: int, route: str, config: dict | None):
    """zerokit.initialize with the case's config; or, route "deepspeed", the Hugging Face Trainer's path through the
    drop-in: deepspeed.tp_model_init, the optimizer built over the whole model, deepspeed.initialize."""
    if route == "zerokit":
        import zerokit
        return zerokit.initialize(model, make_optimizer(case, model), config or tensor_config(case, tensor))
    if route == "torch":  # torch's own tensor parallelism, applied by the user on the layout's tensor mesh
        import zerokit
        layout = Layout.resolve(torch.distributed.get_world_size(), tensor=tensor)
        parallelize_llama(model, layout.device_mesh("cpu")["tensor"])
        return zerokit.initialize(model, make_optimizer(case, model), config or engine_config(case), layout=layout)
    if route == "hf":  # Hugging Face's own plan and styles, as from_pretrained(tp_plan="auto") applies them
        import zerokit
        layout = Layout.resolve(torch.distributed.get_world_size(), tensor=tensor)
        model = hf_tensor_parallel(model, layout.device_mesh("cpu")["tensor"])
        return zerokit.initialize(model, make_optimizer(case, model), config or engine_config(case), layout=layout)
    import zerokit.deepspeed as deepspeed
    os.environ["LOCAL_RANK"] = str(torch.distributed.get_rank())  # as torchrun sets it: one node
    config = config or deepspeed_config(case, tensor)
    dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    model = deepspeed.tp_model_init(model, tp_size=tensor, dtype=dtype, config=config)
    return deepspeed.initialize(model=model, optimizer=make_optimizer(case, model), config=config)[0]


def parallelize_llama(model: torch.nn.Module, mesh) -> None:
    """A Hugging Face Llama parallelized as torchtitan parallelizes its Llama (without sequence parallelism):
    attention and MLP input projections column-wise, output projections row-wise, the LM head column-wise with its
    logits gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for index in range(len(model.model.layers)):
        prefix = f"model.layers.{index}."
        plan.update({prefix + name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj",
                                                                  "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")})
        plan.update({prefix + name: RowwiseParallel() for name in ("self_attn.o_proj", "mlp.down_proj")})
    parallelize_module(model, mesh, plan)


def hf_tensor_parallel(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """`model` with Hugging Face's own tensor parallelism on `mesh`: its plan resolved and applied as
    from_pretrained(tp_plan="auto") resolves and applies it (DistributedMixin._resolve_parallel_plans, then
    apply_tensor_parallelism: transformers' ColwiseParallel/RowwiseParallel forwards and its vocabulary-split
    embedding). from_pretrained itself builds its mesh over every rank (transformers 5.24: "The parallel mesh
    requires 2 processes, but world_size is 4"), so a tensor group inside a larger job takes this path."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_plan="auto", tp_size=mesh.size()))
    return apply_tensor_parallelism(model, mesh, plan)


def run_tensor_engine(rank: int, world_size: int, case: Case, tensor: int, route: str = "zerokit",
                      config: dict | None = None) -> dict:
    """One rank's side of a tensor-parallel parity case: losses (step, replica, loss), step results, the whole
    parameters (full_state_dict, consolidated across the tensor group), and the split dimension of each parameter
    this rank holds a piece of, by name. `route`: see
    start_engine; `config`: a DeepSpeed-style dict instead of the case's."""
    layout = Layout.resolve(world_size, tensor=tensor)
    _, replica, tensor_index = layout.coordinates(rank)
    model = make_model(case)
    engine = start_engine(model, case, tensor, route, config)
    losses, results = [], []
    for step in range(case.steps):
        for micro in range(case.accumulation):
            loss = forward_loss(engine, make_batch(case, step, micro, replica))
            engine.backward(loss)
            result = engine.step()
            losses.append((step, replica, loss.item()))
        results.append(asdict(result))
    names = dict(model.named_parameters())
    split = {name: engine.tensor.split[id(param)] for name, param in names.items() if id(param) in engine.tensor.split}
    params = {name: value for name, value in engine.full_state_dict().items() if name in names}
    out = {"losses": losses, "results": results, "params": params, "split": split, "replica": replica,
           "tensor_index": tensor_index, "data_ranks": engine.comm.world_size,
           "accumulation": engine.config.gradient_accumulation_steps,
           "train_batch_size": engine.config.train_batch_size}
    engine.close()
    return out


def run_tensor_cases(rank: int, world_size: int, runs: list[tuple[Case, str, dict | None]],
                     tensor: int) -> dict[str, dict]:
    """Every (case, route, config) on this rank, one after another: one spawn serves a whole sweep."""
    return {case.name: run_tensor_engine(rank, world_size, case, tensor, route, config)
            for case, route, config in runs}


def run_resume(rank: int, world_size: int, case: Case, tensor: int, route: str = "zerokit") -> dict:
    """Train the case's steps but the last, save a checkpoint, train the last step; then a fresh model and engine
    load the checkpoint and train the last step again. Returns both last steps' losses and whole parameters."""
    directory = [tempfile.mkdtemp(prefix="zerokit-tp-resume-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    replica = Layout.resolve(world_size, tensor=tensor).coordinates(rank).replica
    runs = []
    for resumed in (False, True):
        engine = start_engine(make_model(case), case, tensor, route, None)
        first = case.steps - 1
        if resumed:
            engine.load_checkpoint(directory[0])
        for step in range(first, case.steps) if resumed else range(case.steps):
            for micro in range(case.accumulation):
                loss = forward_loss(engine, make_batch(case, step, micro, replica))
                engine.backward(loss)
                engine.step()
            if not resumed and step == first - 1:
                engine.save_checkpoint(directory[0])
        runs.append({"loss": loss.item(), "params": engine.full_state_dict(), "files": sorted(
            path.name for path in Path(directory[0]).iterdir())})
        engine.close()
    _remove_when_all_done(rank, directory[0])
    return {"uninterrupted": runs[0], "resumed": runs[1]}


def run_relayout(rank: int, world_size: int, case: Case, tensor: int, middle: str) -> dict:
    """The case's three steps across layouts: the first on `tensor` x data ranks, saved; the second on the `middle`
    layout, loaded from that, on the same micro-batches, and saved; the third on the tensor layout again, loaded from
    that. `middle`: "flat" (ZeRO-3 over every rank, rank r reading micro-batch r % accumulation of replica
    r // accumulation) or "all-tensor" (the case's ZeRO stage with every rank one tensor group, reading every
    replica's micro-batches in turn). The last loss and the whole parameters, to set beside run_resume's
    uninterrupted run."""
    directory = [tempfile.mkdtemp(prefix="zerokit-tp-relayout-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(directory, src=0)
    root = Path(directory[0])
    replicas = world_size // tensor
    replica = Layout.resolve(world_size, tensor=tensor).coordinates(rank).replica
    window = [(micro, replica) for micro in range(case.accumulation)]

    def train(engine, step: int, batches: list[tuple[int, int]]) -> float:
        for micro, which in batches:
            loss = forward_loss(engine, make_batch(case, step, micro, which))
            engine.backward(loss)
            engine.step()
        return loss.item()

    first = start_engine(make_model(case), case, tensor, "zerokit", None)
    train(first, 0, window)
    first.save_checkpoint(root / "tensor")
    first.close()
    if middle == "flat":
        middle_case, batches = replace(case, stage=3, accumulation=1), [(rank % case.accumulation,
                                                                          rank // case.accumulation)]
        model = make_model(middle_case)
        import zerokit
        other = zerokit.initialize(model, make_optimizer(middle_case, model),
                                   {**engine_config(middle_case), "train_micro_batch_size_per_gpu": case.micro_batch})
    else:
        middle_case = replace(case, accumulation=case.accumulation * replicas)
        batches = [(micro, which) for which in range(replicas) for micro in range(case.accumulation)]
        other = start_engine(make_model(middle_case), middle_case, world_size, "zerokit", None)
    other.load_checkpoint(root / "tensor")
    consolidated = consolidated_as_loaded(other, str(root / "tensor"))
    train(other, 1, batches)
    other.save_checkpoint(root / "middle")
    other.close()
    last = start_engine(make_model(case), case, tensor, "zerokit", None)
    last.load_checkpoint(root / "middle")
    loss = train(last, 2, window)
    out = {"loss": loss, "params": last.full_state_dict(), "consolidated": consolidated,
           "tensor_parts": sorted(path.name for path in (root / "tensor").iterdir()),
           "middle_parts": sorted(path.name for path in (root / "middle").iterdir())}
    last.close()
    _remove_when_all_done(rank, root)
    return out


def _remove_when_all_done(rank: int, directory: str | Path) -> None:
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
