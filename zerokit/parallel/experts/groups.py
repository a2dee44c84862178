"""The process group a rank's ExpertParallelMoE exchanges tokens over, made from the job's mesh (mesh.py: the expert
groups are blocks of consecutive replicas, DeepSpeed's "expert before data" order; See [Note: the expert dimension]
in zerokit/parallel/mesh.py). Averaging the experts' gradients over the expert-data groups is the engine's business
and not done here.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerokit.parallel.mesh import Layout


def expert_parallel_group(ep: int) -> Any:
    """This rank's expert group when the whole world is data-parallel (no pipeline, tensor or sequence ranks), split
    into expert groups of `ep` ranks; None where ep is 1. Every rank must call it, at the same point."""
    return expert_group(Layout.resolve(dist.get_world_size(), expert=ep))


def expert_group(layout: Layout) -> Any:
    """This rank's expert group of `layout`, None where its expert degree is 1. torch makes every group on every
    rank, so every rank makes all of them, in the mesh's order, and keeps its own."""
    if layout.expert == 1:
        return None
    mine = None
    for ranks in layout.expert_groups():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine
