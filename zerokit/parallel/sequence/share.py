"""The engine's sequence dimension: the layout with the config's sequence degree, this rank's sequence group, and
the model's attention attached to it (See zerokit/parallel/sequence)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerokit.config.settings import TensorSettings
from zerokit.parallel.mesh import Layout
from zerokit.parallel.sequence.attention import attach
from zerokit.parallel.sequence.batch import sequence_loss, shard_batch
from zerokit.parallel.sequence.tiling import ModelRunner, final_hidden_states, tiled_loss


@dataclass(frozen=True)
class SequenceShare:
    """This rank's place in its replica's sequences: `engine.sequence`."""

    group: Any
    rank: int
    ranks: int

    def shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of its replica's batch (See shard_batch)."""
        return shard_batch(batch, self.rank, self.ranks)

    def loss(self, logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        """The replica's mean next-token loss, on every sequence rank (See sequence_loss)."""
        return sequence_loss(logits, shift_labels, self.group)

    def hidden_states(self, engine: ModelRunner, **inputs: Any) -> torch.Tensor:
        """This rank's last hidden states from the engine's forward on its shard's `inputs`, with no logits
        computed: for tiled_loss (See final_hidden_states)."""
        return final_hidden_states(engine, **inputs)

    def tiled_loss(self, hidden: torch.Tensor, lm_head: nn.Module, shift_labels: torch.Tensor,
                   tiles: int) -> torch.Tensor:
        """loss(lm_head(hidden), shift_labels) with one of `tiles` slices of the logits alive at a time (See
        tiled_loss in tiling.py)."""
        return tiled_loss(hidden, lm_head, shift_labels, tiles, self.group)


def sequence_layout(layout: Layout | None, part: TensorSettings) -> Layout | None:
    """The job's layout with the config's sequence degree (See with_sequence_degree)."""
    return with_sequence_degree(layout, part.sequence_parallel_size)


def with_sequence_degree(layout: Layout | None, degree: int) -> Layout | None:
    """The job's layout with a sequence degree: `layout` where there is none to add or it has the same one; else
    the layout resolved again with it, its pipeline and tensor degrees kept (sequence ranks inside each replica, the
    replicas what is left). A pipeline stage's rank stays at its stage: the ranks of a stage are consecutive whatever
    splits them (See [Note: the sequence dimension] in parallel/mesh.py)."""
    if degree <= 1:
        return layout
    if layout is not None and layout.sequence == degree:
        return layout
    if layout is not None and layout.sequence > 1:
        raise ValueError(f"sequence_parallel_size={degree} but the layout has {layout.sequence} sequence rank(s) "
                         f"({layout.describe()}): give the same degree, or leave one of them out")
    pipeline, tensor = (1, 1) if layout is None else (layout.pipeline, layout.tensor)
    return Layout.resolve(dist.get_world_size(), pipeline=pipeline, sequence=degree, tensor=tensor)


def sequence_share(layout: Layout | None, model: nn.Module) -> SequenceShare | None:
    """This rank's sequence group (every rank makes every group, in order) and the model's attention attached to it;
    None where the layout has no sequence dimension."""
    if layout is None or layout.sequence == 1:
        return None
    me, mine = dist.get_rank(), None
    for ranks in layout.sequence_groups():
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    attach(model, mine, layout.sequence, layout.tensor)
    return SequenceShare(mine, layout.sequence_index(me), layout.sequence)


def startup_lines(layout: Layout | None) -> list[str]:
    if layout is None or layout.sequence == 1:
        return []
    zero_ranks = layout.data * layout.sequence  # a data group: a stage's ranks of one tensor index
    return [f"sequence parallel (Ulysses): {layout.describe()}; each replica's sequences split over {layout.sequence} "
            f"consecutive ranks, ZeRO over {zero_ranks} (replicas x sequence ranks); batch sizes count the "
            f"{layout.data} replica(s)"]
