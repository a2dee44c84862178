"""What an engine does about tensor parallelism when it is built, in order: the layout with the config's tensor degree
(the DeepSpeed route: `tensor_parallel.autotp_size`), the plan checked, the tensor group made, the model split by the
plan, and the TensorShare the optimizer step adds its squares over.

[Note: batch sizes under AutoTP count the tensor ranks]
DeepSpeed 0.19.8 derives the batch identity train_batch_size = micro-batch x accumulation x world size over every
rank, tensor ranks included, though the ranks of a tensor group read the same batch: with 2 tensor x 2 data ranks,
train_batch_size 16 and micro-batch 4 is one micro-step per optimizer step, and 8 fails ("Gradient accumulation
steps: 0"). A config written for DeepSpeed must train the same steps under zerokit, so where the tensor degree comes
from the config's tensor_parallel block the batch sizes count every rank, as DeepSpeed does, and the start-up log
says so. Where the caller passes a Layout of its own they count the data replicas, the ranks that read distinct data.

[Note: a checkpoint per tensor rank]
Each tensor rank's engine shards its pieces over its data group and checkpoints them with that group alone (the
checkpoint session's group is the engine's data group: See checkpoint/session.py), into a directory of its own under
the one the caller names, `tensor<j>-of-<t>`, with its own `latest`: the tensor ranks' files never meet, a save is
atomic within each, and a run resumes exactly at the same tensor degree (at any data degree and stage, as any zerokit
checkpoint). Into another tensor degree, or none, the pieces are read together as whole tensors and cut again (See
[Note: a checkpoint per stage and tensor rank, read as one] in checkpoint/relayout.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.distributed as dist
from torch import nn

from zerokit.comm import Communicator
from zerokit.parallel.mesh import Layout
from zerokit.parallel.remap import refuse_stepped_state, remap_parameters
from zerokit.config.settings import TensorSettings, ranks_per_node
from zerokit.parallel.tensor.autotp import planned_splits, split_model
from zerokit.parallel.tensor.layers import split_parameters
from zerokit.parallel.tensor.share import TensorShare
from zerokit.parallel.tensor.torch_tp import adopt_dtensor_linears, has_dtensors, planned_adoptions


def tensor_layout(layout: Layout | None, part: TensorSettings) -> Layout | None:
    """The job's layout with the config's tensor degree: `layout` itself where the config asks for none or the
    same; one resolved from torchrun's world (the tensor group inside a node) where the caller gave none."""
    degree = part.autotp_size
    if degree <= 1:
        return layout
    if layout is None:
        world = dist.get_world_size()
        per_node = ranks_per_node(part.ranks_per_node, part.launcher_ranks_per_node, world)
        return Layout.resolve(world, tensor=degree, ranks_per_node=per_node)
    if layout.tensor != degree:
        raise ValueError(f"tensor_parallel.autotp_size={degree} but the layout has {layout.tensor} tensor rank(s) "
                         f"({layout.describe()}): give the same degree, or leave one of them out")
    return layout


def parallelize(model: nn.Module, layout: Layout | None, part: TensorSettings, optimizer: Any,
                model_parameters: Iterable[Any] | None) -> tuple[TensorShare | None, Any, Iterable[Any] | None]:
    """The model split by its plan where the config asks for AutoTP, or its DTensor linears adopted where the caller
    parallelized it, and the tensor group's TensorShare (None where the layout has no tensor dimension); with
    `optimizer` and `model_parameters`, given over the whole model, pointed at the pieces (See remap_parameters).
    Everything is checked before the tensor group is made (See [Note: the plan is checked before any group is made]
    in autotp.py)."""
    if layout is None or layout.tensor == 1:
        return None, optimizer, model_parameters
    if part.autotp_size > 1 and has_dtensors(model):
        raise ValueError("tensor_parallel.autotp_size splits a whole model, but this one is parallelized already "
                         "(DTensor parameters): drop the tensor_parallel block and pass layout=")
    splits = planned_splits(model, layout.tensor) if part.autotp_size > 1 else []
    tensor_group = next(ranks for ranks in layout.tensor_groups() if dist.get_rank() in ranks)
    adoptions = planned_adoptions(model, tensor_group) if has_dtensors(model) else []
    # See [Note: the local piece of a DTensor is the parameter ZeRO shards] in torch_tp.py
    cut = [model.get_submodule(split.name) for split in splits] + [p.module for p in adoptions if p.how != "whole"]
    planned = cut + [plan.module for plan in adoptions if plan.how == "whole"]
    if not cut and not split_parameters(model):  # every tensor rank would train a whole copy on the same batches
        raise ValueError(f"the layout has {layout.tensor} tensor ranks but the model has no split layers: give "
                         "the config's tensor_parallel.autotp_size, or parallelize the model on "
                         "layout.device_mesh(...)['tensor'] first")
    refuse_stepped_state(optimizer, {id(p) for module in planned for p in module.parameters(recurse=False)})
    comm = Communicator.create(part.timeout_seconds, parts=layout.tensor_groups(), name="tensor")
    replaced = adopt_dtensor_linears(model, adoptions, comm) if adoptions else split_model(model, splits, comm)
    optimizer, model_parameters = remap_parameters(optimizer, model_parameters, replaced)
    made_whole = tuple(plan.name for plan in adoptions if plan.how == "whole")
    return TensorShare(comm, split_parameters(model), made_whole), optimizer, model_parameters


def batch_ranks(layout: Layout | None, part: TensorSettings) -> int | None:
    """The ranks the batch identity counts (See [Note: batch sizes under AutoTP count the tensor ranks]): the data and
    tensor ranks where the config's tensor degree made the layout; None: the data ranks."""
    if layout is not None and part.autotp_size > 1:
        return layout.data * layout.tensor
    if layout is not None and layout.sequence > 1:  # the sequence ranks of a replica read one batch
        return layout.data
    return None


def startup_lines(layout: Layout | None, part: TensorSettings, share: TensorShare | None) -> list[str]:
    if share is None or layout is None:
        return []
    split = len(share.split)
    lines = [f"tensor parallel: {layout.describe()}; {split} parameter(s) split over the tensor group (consecutive "
             "ranks), the rest replicated; ZeRO shards over the data group"]
    if share.made_whole:
        lines.append(f"{', '.join(share.made_whole)}: split by the caller's plan, held whole on every tensor rank (an "
                     "embedding's lookup needs no collective then; ZeRO shards it over the data group)")
    if part.autotp_size > 1:
        lines.append(f"tensor_parallel.autotp_size={part.autotp_size}: batch sizes count all "
                     f"{layout.data * layout.tensor} ranks as DeepSpeed does (train_batch_size = micro-batch x "
                     f"accumulation x {layout.data * layout.tensor}), though only {layout.data} replica(s) read "
                     "distinct data: the ranks of a tensor group must read the same batch")
    return lines
