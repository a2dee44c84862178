"""Who is grouped with whom: the job's ranks as a mesh of pipeline stages x data replicas (x sequence ranks) x tensor
ranks.

[Note: one layout, resolved once]
Pipeline and tensor parallelism add one question to every part of zerokit: which ranks does this collective go
over? It is answered here and nowhere else. A Layout is three degrees (pipeline, data, tensor), checked once
against the world size; every module that needs a group asks it for the rank lists of one dimension
(`data_groups()`, `pipeline_groups()`, `tensor_groups()`) or for this rank's coordinates, and is handed them as
plain values, as torchtitan's ParallelDims hands out its sub-meshes. Hybrid sharding (MiCS, hpZ) is the data
dimension's inner shape and stays in EngineSettings: the engine shards over its data group as it shards over
the world without a layout.

Ranks are numbered as DeepSpeed's PipeModelDataParallelTopology numbers them (axes pipe, data, model, the last
innermost), and as torch's DeviceMesh of shape (pipeline, data, tensor) does:
    rank = (stage * data + replica) * tensor + tensor_index
so the tensor group is consecutive ranks (one node, the per-layer all-reduces on its fastest links), a stage's
data group stays inside a node where the node holds it, and the pipeline's stages fall across nodes, where only
activations travel between them. A DeepSpeed pipeline script that shards its data by `grid.data_parallel_id`
reads the same batches under zerokit.

[Note: the sequence dimension]
Sequence parallelism (Ulysses: See zerokit/parallel/sequence) splits each replica's sequences over `sequence`
ranks, which read the same batch and hold the same model; so ZeRO shards the model states over replicas and
sequence ranks alike (its data group is every rank of a stage's tensor index, as DeepSpeed's sequence-data group
is), while `data` still counts the replicas that read distinct batches. The sequence ranks of a replica are
consecutive, as DeepSpeed's mpu numbers them (`initialize_sequence_parallel`), so its all-to-alls stay in a node:
    rank = ((stage * data + replica) * sequence + sequence_index) * tensor + tensor_index
Under a pipeline every stage's ranks split alike, and a pipeline group joins the same replica and sequence index of
every stage: the activations of a shard's tokens go to the next stage's rank that holds the same tokens.

[Note: the expert dimension]
Expert parallelism (a mixture-of-experts layer's experts split over `expert` ranks, each token sent to its
expert's rank and back: See zerokit/parallel/experts) lies inside the data dimension, as DeepSpeed's does: the
replicas of a stage's tensor and sequence index are cut into blocks of `expert` consecutive replicas, each block an
expert group that holds every expert once between its ranks, and the replicas at the same place in every block hold
the same experts: their expert-data group (with the sequence ranks of those replicas, which hold the same experts as
their replica), over which ZeRO shards and reduces the experts' states, while the other parameters shard over the
whole data group. With tensor parallelism, the expert groups of each tensor index are the ones DeepSpeed's mpu-based
groups make (_create_expert_data_and_model_parallel); without it, deepspeed.utils.groups' default ("expert before
data"): [[0, 1], [2, 3]] and expert-data [[0, 2], [1, 3]] for 4 replicas at an expert degree of 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Coordinates(NamedTuple):
    stage: int
    """The pipeline stage this rank runs."""
    replica: int
    """Its index in its data group: which data it reads, which shard of the model states it holds."""
    tensor_index: int
    """Its index in its tensor group: which piece of each split layer it computes."""


@dataclass(frozen=True)
class Layout:
    pipeline: int = 1
    data: int = 1
    tensor: int = 1
    sequence: int = 1
    """Ranks each replica's sequences are split over (See [Note: the sequence dimension])."""
    expert: int = 1
    """Consecutive replicas a mixture-of-experts layer's experts are split over (See [Note: the expert dimension])."""

    @classmethod
    def resolve(cls, world_size: int, pipeline: int = 1, tensor: int = 1, ranks_per_node: int | None = None,
                sequence: int = 1, expert: int = 1) -> "Layout":
        """The layout of `world_size` ranks with these pipeline, tensor, sequence and expert degrees; the data degree
        is what the first three leave, and the expert degree splits it. One line names the degree that does not fit,
        and what would."""
        for name, degree in (("pipeline", pipeline), ("tensor", tensor), ("sequence", sequence), ("expert", expert)):
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ValueError(f"the {name} degree must be a positive integer, got {degree!r}")
        model = pipeline * tensor * sequence
        if world_size % model:
            sequence_ranks = f" x {sequence} sequence rank(s)" if sequence > 1 else ""
            raise ValueError(f"{world_size} ranks do not split into {pipeline} pipeline stage(s){sequence_ranks} x "
                             f"{tensor} tensor rank(s): the world size must be a multiple of their product, {model}")
        if ranks_per_node is not None and ranks_per_node % tensor:
            raise ValueError(f"a tensor degree of {tensor} does not divide the {ranks_per_node} ranks of a node: "
                             f"a tensor group must sit inside one node (accepted: a divisor of {ranks_per_node})")
        data = world_size // model
        if data % expert:
            raise ValueError(f"an expert degree of {expert} does not divide the {data} data replica(s) of {world_size} "
                             f"ranks: the experts split over replicas (accepted: a divisor of {data})")
        return cls(pipeline=pipeline, data=data, tensor=tensor, sequence=sequence, expert=expert)

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data * self.sequence * self.tensor

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        stage, rest = divmod(rank, self.data * self.sequence * self.tensor)
        return Coordinates(stage, rest // (self.sequence * self.tensor), rest % self.tensor)

    def sequence_index(self, rank: int) -> int:
        """Which part of its replica's sequences `rank` holds."""
        return rank // self.tensor % self.sequence

    def rank_of(self, stage: int, replica: int, tensor_index: int = 0, sequence_index: int = 0) -> int:
        return ((stage * self.data + replica) * self.sequence + sequence_index) * self.tensor + tensor_index

    def data_groups(self) -> list[list[int]]:
        """The ranks that differ only in their replica (and sequence index): each holds a shard of one stage's piece
        of the model states; ZeRO reduces, gathers and shards over them (See [Note: the sequence dimension])."""
        return [[self.rank_of(s, r, t, q) for r in range(self.data) for q in range(self.sequence)]
                for s in range(self.pipeline) for t in range(self.tensor)]

    def sequence_groups(self) -> list[list[int]]:
        """The ranks that differ only in their sequence index: the parts of one replica's sequences, which Ulysses'
        all-to-alls go over."""
        return [[self.rank_of(s, r, t, q) for q in range(self.sequence)]
                for s in range(self.pipeline) for r in range(self.data) for t in range(self.tensor)]

    def expert_groups(self) -> list[list[int]]:
        """Blocks of `expert` consecutive replicas of one stage's tensor and sequence index: each holds every expert
        once between its ranks, and its tokens travel between them (See [Note: the expert dimension])."""
        return [[self.rank_of(s, block + i, t, q) for i in range(self.expert)]
                for s in range(self.pipeline) for block in range(0, self.data, self.expert)
                for q in range(self.sequence) for t in range(self.tensor)]

    def expert_data_groups(self) -> list[list[int]]:
        """The ranks that hold the same experts (the same place in every expert group, and their sequence ranks):
        ZeRO shards and reduces the experts' states over them (See [Note: the expert dimension])."""
        return [[self.rank_of(s, r, t, q) for r in range(place, self.data, self.expert) for q in range(self.sequence)]
                for s in range(self.pipeline) for t in range(self.tensor) for place in range(self.expert)]

    def pipeline_groups(self) -> list[list[int]]:
        """The ranks that differ only in their stage, in stage order: one pipeline, which passes activations."""
        return [[self.rank_of(s, r, t, q) for s in range(self.pipeline)]
                for r in range(self.data) for q in range(self.sequence) for t in range(self.tensor)]

    def tensor_groups(self) -> list[list[int]]:
        """The ranks that differ only in their tensor index: the pieces of one stage's split layers."""
        return [[self.rank_of(s, r, t, q) for t in range(self.tensor)]
                for s in range(self.pipeline) for r in range(self.data) for q in range(self.sequence)]

    def group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        """The one of `groups` (a dimension's rank lists) that holds `rank`."""
        return next(group for group in groups if rank in group)

    def device_mesh(self, device_type: str):
        """torch's DeviceMesh of this layout, with the dimensions named "pipeline", "data" and "tensor" (for
        DTensor's tensor parallelism and torch's pipelining); every rank must call it, at the same point."""
        from torch.distributed.device_mesh import init_device_mesh
        if self.sequence > 1:
            return init_device_mesh(device_type, (self.pipeline, self.data, self.sequence, self.tensor),
                                    mesh_dim_names=("pipeline", "data", "sequence", "tensor"))
        return init_device_mesh(device_type, (self.pipeline, self.data, self.tensor),
                                mesh_dim_names=("pipeline", "data", "tensor"))

    def describe(self) -> str:
        sequence = f" x {self.sequence} sequence rank(s)" if self.sequence > 1 else ""
        experts = f" (experts split over {self.expert} of them)" if self.expert > 1 else ""
        return (f"{self.pipeline} pipeline stage(s) x {self.data} data replica(s){experts}{sequence} x {self.tensor} "
                "tensor rank(s)")


def checked_layout(layout: Layout | None) -> Layout | None:
    """`layout` as an engine takes it: one over the job's ranks (None: the engine shards over every rank)."""
    if layout is None:
        return None
    import torch.distributed as dist
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a zerokit.Layout (Layout.resolve(world_size, pipeline=..., tensor=...)), "
                        f"got {type(layout).__name__}")
    if layout.world_size != dist.get_world_size():
        raise ValueError(f"the layout ({layout.describe()}) has {layout.world_size} ranks but the job has "
                         f"{dist.get_world_size()}: resolve it with Layout.resolve(world_size, ...)")
    return layout
