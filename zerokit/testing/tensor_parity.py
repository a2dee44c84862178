"""Parity under tensor parallelism: a parity case (parity.py) trained on a layout of tensor x data ranks, the model
split by AutoTP's plan (config `tensor_parallel.autotp_size`), against one process on the union of the replicas'
batches (parity.run_reference with the replica count as its world size). The ranks of a tensor group read their
replica's batch, as DeepSpeed's AutoTP requires."""

from __future__ import annotations

from dataclasses import asdict

import torch

from zerokit.layout import Layout
from zerokit.testing.parity import Case, engine_config, forward_loss, make_batch, make_model, make_optimizer


def tensor_config(case: Case, tensor: int) -> dict:
    """The case's DeepSpeed-style dict with the tensor block and the micro-batch, as DeepSpeed's AutoTP configs
    give them (train_batch_size is then derived over every rank: See [Note: batch sizes under AutoTP count the
    tensor ranks])."""
    return {**engine_config(case), "tensor_parallel": {"autotp_size": tensor},
            "train_micro_batch_size_per_gpu": case.micro_batch}


def run_tensor_engine(rank: int, world_size: int, case: Case, tensor: int) -> dict:
    """One rank's side of a tensor-parallel parity case: losses (step, replica, loss), step results, this rank's
    pieces of the parameters (full_state_dict), and the split dimension of each piece by name."""
    import zerokit

    layout = Layout.resolve(world_size, tensor=tensor)
    _, replica, tensor_index = layout.coordinates(rank)
    model = make_model(case)
    engine = zerokit.initialize(model, make_optimizer(case, model), tensor_config(case, tensor))
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


def run_tensor_cases(rank: int, world_size: int, cases: list[Case], tensor: int) -> dict[str, dict]:
    """Every case on this rank, one after another: one spawn serves a whole sweep."""
    return {case.name: run_tensor_engine(rank, world_size, case, tensor) for case in cases}


def piece_of(whole: torch.Tensor, dim: int | None, tensor: int, tensor_index: int) -> torch.Tensor:
    """Tensor rank `tensor_index`'s piece of a whole parameter split on `dim` (None: replicated, the whole)."""
    return whole if dim is None else whole.chunk(tensor, dim=dim)[tensor_index]
