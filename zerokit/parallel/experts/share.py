"""The engine's expert room (issue 45, item 3): the model's expert degree in the job's layout, the layers' expert
groups, and which parameters are experts', sharded and averaged over their expert-data group.

[Note: ZeRO over experts split across ranks]
A layer that splits its experts over an expert group of `ep` ranks (ExpertParallelMoE, DeepSpeed's MoE through the
drop-in, and a Hugging Face model's experts under the config's expert_parallel block: hf.py) gives each rank of the
group other experts. The dense parameters are the same on every rank and shard over
the whole data group; expert e lives only on the ranks at its place in every expert group, its expert-data group of
data / ep ranks (See [Note: the expert dimension] in zerokit/parallel/mesh.py). So the engine builds a second stage
over the experts' parameters alone, sharded over the expert-data group (its own flat buffer, masters, hooks and
reductions), beside the dense stage. What differs from one stage alone:
  - averaging: on one rank, expert e's gradient holds what the tokens of every rank of its expert group sent it, so
    the sum over the expert-data group holds every rank's part; one process's average divides that sum by the whole
    data degree, which is ep times the group's own average (the stage's `expert_degree`: stages/averaging.py);
  - the norm and overflow are one number over both stages on every rank, as one process clips: the experts' squares
    join the dense ones in the boundary's all-reduce over every rank (at stages 1-3 each expert element is held by
    one rank; at stage 0, where a group's ranks hold the same full gradients, its first rank counts them and the
    others add theirs times zero, so an inf still counts), so an inf anywhere is a nan everywhere and every rank skips
    the step together (zerokit/engine/step.py);
  - which expert parameters got a gradient is agreed over the expert-data group alone: other groups hold other experts;
  - one optimizer steps the masters of both stages (share_optimizers in zerokit/masters/shards.py), so a schedule set
    on engine.optimizer sets both;
  - at start, each expert-data group takes its first rank's experts, as the dense parameters take rank 0's.
DeepSpeed 0.19.8's ZeRO 1-2 averages and clips the same (its norm equals this one on tests/scripts/ds_moe.py at 2 x 2
and 4 x 1 ranks); it refuses its native MoE at ZeRO 3. Not yet with the experts split: MiCS, NVMe offload, a model
built on the meta device, pipeline, tensor or sequence degrees beside the expert one, and checkpoints (each refused in
one line).

[Note: split experts in a ZeRO-3 job]
At ZeRO-3 both stages are stage 3, each over its own parameters: the dense one cuts the model into units as always,
leaving the experts' parameters out of its buckets, trainable and frozen alike (ShardedParameters.build's
held_elsewhere); the experts' one makes each local expert a unit (the layer calls each expert, not their container),
sharded over the expert-data group, gathered before the expert runs and freed after, forward and backward, and leaves
every other parameter to the dense one. Each stage's hooks run their own units; an expert gathers over its
expert-data group only. hpZ's secondary copy is the dense stage's alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import nn

from zerokit.comm import Communicator
from zerokit.config.settings import EngineSettings, StageSettings, TensorSettings
from zerokit.parallel.experts.groups import expert_group
from zerokit.parallel.experts.hf import SplitHFExperts
from zerokit.parallel.experts.layer import ExpertParallelMoE
from zerokit.parallel.mesh import Layout


@dataclass(frozen=True)
class ExpertShare:
    """A model's experts split over ranks: the expert degree, the group their states shard over, and which
    parameters they are."""

    degree: int
    data: Communicator
    """The expert-data group: the ranks that hold this rank's experts (See [Note: the expert dimension])."""
    params: frozenset[int]
    """ids of the experts' parameters."""
    modules: tuple[nn.Module, ...]
    """Every local expert module of every MoE layer: at ZeRO-3, the experts' stage's units (the layers call each
    expert, not their container)."""

    def settings(self, dense: EngineSettings) -> EngineSettings:
        """The expert stage's decisions: the dense stage's over the expert-data group, averaged over the job (no hpZ
        copy: See [Note: split experts in a ZeRO-3 job])."""
        size = self.data.world_size
        return replace(dense, world_size=size, shard_size=size, secondary_size=1, expert_degree=self.degree)

    def part(self, dense: StageSettings) -> StageSettings:
        """The expert stage's part of the settings: the dense stage's, with each local expert a unit at ZeRO-3 (and no
        small parameter kept whole with the root, which holds none of the experts')."""
        return replace(dense, units=replace(dense.units, unit_classes=(), units=self.modules, persistence_threshold=0))


SPLIT_LAYERS = (ExpertParallelMoE, SplitHFExperts)
"""What holds experts split over an expert group: `ep`, `group`, `set_group(group)` and `experts`, this rank's."""


_SPLIT = weakref.WeakSet()  # the split layers of engines built so far (See split_expert_storages)


def split_expert_storages() -> set[int]:
    """The data pointers of every split expert's parameters in the process: a state dict holding one of them holds
    one rank's experts, not the model's (zerokit/deepspeed/checkpoint/utils.py refuses to pass it off as the
    model's)."""
    return {param.data_ptr() for layer in list(_SPLIT) for param in layer.experts.parameters()}


def expert_layers(model: nn.Module) -> list[ExpertParallelMoE | SplitHFExperts]:
    return [module for module in model.modules() if isinstance(module, SPLIT_LAYERS)]


def expert_degree(model: nn.Module, configured: int = 1) -> int:
    """The ranks the model's MoE layers split their experts over (1: none split, or no MoE layer); `configured`: the
    config's expert_parallel degree, which splits a Hugging Face model's experts once the layout is made."""
    degrees = sorted({layer.ep for layer in expert_layers(model)} | ({configured} if configured > 1 else set()))
    if len(degrees) > 1:
        raise ValueError(f"the model's MoE layers split their experts over {degrees} ranks; zerokit shards experts "
                         "over one expert degree: give every layer the same ep_size (and expert_parallel.autoep_size)")
    return degrees[0] if degrees else 1


def expert_layout(layout: Layout | None, model: nn.Module, part: TensorSettings | None = None) -> Layout | None:
    """The job's layout with the model's expert degree (See [Note: the expert dimension] in zerokit/parallel/mesh.py),
    its layers' or the config's (`part.expert_parallel_size`); `layout` itself where nothing splits experts."""
    degree = expert_degree(model, 1 if part is None else part.expert_parallel_size)
    if degree == 1:
        return layout
    if layout is not None and (layout.pipeline, layout.tensor, layout.sequence) != (1, 1, 1):
        raise ValueError(f"MoE layers with experts split over {degree} ranks beside pipeline {layout.pipeline}, "
                         f"tensor {layout.tensor} or sequence {layout.sequence} degrees are not offered yet; accepted: "
                         "an expert degree inside a data-parallel job")
    if layout is not None and layout.expert not in (1, degree):
        raise ValueError(f"the layout's expert degree {layout.expert} differs from the {degree} ranks the model's MoE "
                         "layers split their experts over; give the layers ep_size equal to the layout's")
    return Layout.resolve(dist.get_world_size(), expert=degree)


def refuse_with_experts(mics: bool, nvme: bool, meta: bool) -> None:
    """One line for what the experts' own stage does not do yet (See [Note: ZeRO over experts split across
    ranks])."""
    if meta:
        raise ValueError("a model built on the meta device with MoE experts split over ranks (ep_size > 1) is not "
                         "offered yet; build it on the CPU (each rank holds only its own experts), or use ep_size=1")
    if mics:
        raise ValueError("zero_optimization.mics_shard_size with MoE experts split over ranks (ep_size > 1) is not "
                         "offered yet; drop the key, or use ep_size=1")
    if nvme:
        raise ValueError("offload to nvme with MoE experts split over ranks (ep_size > 1) is not offered yet; "
                         "accepted: offload to cpu, or none")


def split_experts_error(call: str) -> ValueError:
    """What a state or checkpoint call that does not gather split experts says (issue 45, item 6)."""
    return ValueError(f"{call} with MoE experts split over ranks (ep_size > 1) is not offered yet; accepted: "
                      "save_checkpoint()/load_checkpoint() in zerokit's format (any expert degree, stage and world "
                      "size), and `zerokit consolidate` for the whole model's weights")


def expert_share(layout: Layout | None, model: nn.Module, comm: Communicator) -> ExpertShare | None:
    """With a layout whose expert degree splits the model's MoE layers: give each layer its expert group (where it has
    none), make the expert-data group `comm` (the data group) splits into, and name the experts' parameters; None
    where nothing is split. Every rank calls it at the same point: torch makes every group on every rank."""
    layers = expert_layers(model)
    if layout is None or layout.expert == 1 or not layers:
        return None
    group = expert_group(layout)
    for layer in layers:
        if layer.group is None:
            layer.set_group(group)
        elif dist.get_process_group_ranks(layer.group) != dist.get_process_group_ranks(group):
            raise ValueError(f"an MoE layer's expert group {dist.get_process_group_ranks(layer.group)} is not this "
                             f"rank's expert group of the job's layout, {dist.get_process_group_ranks(group)}")
    params = {id(param) for layer in layers for param in layer.experts.parameters()}
    _refuse_shared(model, params)
    _SPLIT.update(layers)
    return ExpertShare(layout.expert, comm.split(layout.expert_data_groups(), "expert_data"), frozenset(params),
                       tuple(expert for layer in layers for expert in layer.experts))


def _refuse_shared(model: nn.Module, params: set[int]) -> None:
    """An expert's parameter used outside its MoE layer too would be averaged as an expert's on one path and a dense
    one's on the other: refused."""
    expert_names = {name for layer_name, layer in model.named_modules() if isinstance(layer, SPLIT_LAYERS)
                    for name, _ in layer.experts.named_parameters(prefix=f"{layer_name}.experts" if layer_name
                                                                  else "experts", remove_duplicate=False)}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in params and name not in expert_names:
            raise ValueError(f"{name} is an MoE expert's parameter used outside its MoE layer; an expert split over "
                             "ranks must be its layer's alone (give the other use a parameter of its own)")


def startup_lines(share: ExpertShare | None, numel: int) -> list[str]:
    """The start-up line for split experts (`numel`: their trainable elements on this rank); none without."""
    if share is None:
        return []
    return [f"MoE experts split over {share.degree} ranks: this rank's {numel:,} expert parameters in a ZeRO stage of "
            f"their own over an expert-data group of {share.data.world_size} rank(s), their gradients averaged over "
            "the whole data group and clipped by one global norm with the dense ones"]
