"""What this rank holds of each parameter, seen per parameter rather than per bucket: the one view that
checkpoints (save, load, the DeepSpeed import), `full_state_dict()` and the planner's recorder read, so that
none of them reaches into a stage's buckets, masters or frozen shards.

[Note: a per-parameter view of the stage]
A stage keeps parameters in flat buckets cut at arbitrary offsets, masters in optimizer pieces, and at stage 3
frozen parameters in shards of their own; which of these exist, and where, differs from stage to stage.
What code outside the stage needs is FSDP2's per-parameter picture (a DTensor per parameter is the one thing
torch's DCP sees): for each trainable parameter, its name, its shape, and the optimizer pieces this rank
steps (where each begins within the flattened parameter, its fp32 values, its optimizer and param group, the
key of its optimizer state); for each frozen parameter, the part this rank holds; the persistent buffers;
and `after_load`, which makes what was written into the pieces and parts the model's values again. The view
is computed when asked for: it holds references into the stage, never copies.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, closing, contextmanager
from typing import Any, Iterator, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn

from zerokit.flat import FlatLayout, FlatParameters
from zerokit.masters import ShardMasters
from zerokit.masters.optimizer import WHOLE_TENSOR


class PieceView(NamedTuple):
    """One optimizer piece of a trainable parameter, as this rank steps it."""

    begin: int  # its first element within the (flattened) parameter
    values: torch.Tensor  # the fp32 master values (a view: writing into it changes the master)
    key: nn.Parameter  # where the optimizer keeps its state: optimizer.state[key]
    optimizer: torch.optim.Optimizer
    optimizer_index: int  # in the engine's list of optimizers
    group: int  # its param group within that optimizer


class TrainableView(NamedTuple):
    name: str  # the state-dict name (a tied parameter's first)
    shape: tuple[int, ...]
    whole_tensor: bool  # its optimizer reads whole tensors (each piece is the whole parameter, shaped)
    pieces: list[PieceView]  # in order of `begin`; contiguous


class FrozenView(NamedTuple):
    name: str
    shape: tuple[int, ...]
    begin: int  # its first element within the parameter
    values: torch.Tensor  # this rank's part (the whole parameter where it is held whole), writable
    whole: bool  # every rank holds all of it (stages 0-2, and parameters stage 3 does not shard)


class Stage(Protocol):
    """What the view reads of a stage (stages/base.py's ZeroStage)."""

    global_rank: int
    global_world_size: int
    replica_index: int
    shards_optimizer: bool
    layout: FlatLayout
    flat: FlatParameters
    masters: ShardMasters

    def frozen_parts(self) -> tuple[set[int], list[FrozenView]]: ...
    def after_load(self) -> None: ...
    def saving_plan(self, model: nn.Module) -> list[tuple[Any, list[nn.Parameter]]]: ...
    def gathered(self, units: Any = None, write_back: bool = False) -> AbstractContextManager[None]: ...


class ParameterView:
    """See [Note: a per-parameter view of the stage]. `kinds[i]`: optimizer i's kind (optimizer_kind)."""

    def __init__(self, stage: Stage, module: nn.Module, kinds: list[str]) -> None:
        self.stage, self.module = stage, module
        self.optimizers = list(stage.masters.optimizers)
        self.whole_tensor = [kind == WHOLE_TENSOR for kind in kinds]
        self.rank, self.world_size = stage.global_rank, stage.global_world_size  # the job's, not the shard group's

    @property
    def layout(self) -> FlatLayout:
        """The trainable parameters' buckets (a checkpoint's manifest describes them)."""
        return self.stage.layout

    @property
    def replicated(self) -> bool:
        """Every rank steps every master (stage 0): each parameter then needs saving by one rank only."""
        return not self.stage.shards_optimizer and self.world_size > 1

    @property
    def writes_shards(self) -> bool:
        """This rank's shards are saved by it: always, except on MiCS replicas other than the first, which hold
        the same shards as replica 0 (See [Note: hybrid sharding] in comm/groups.py)."""
        return self.stage.replica_index == 0

    def trainable(self) -> list[TrainableView]:
        """Each trainable parameter this rank steps some of, with its pieces, in layout order."""
        slots = {slot.param_index: slot for bucket in self.stage.layout.buckets for slot in bucket.slots}
        position = {id(o): i for i, o in enumerate(self.optimizers)}
        group_of = {id(p): g for o in self.optimizers for g, group in enumerate(o.param_groups)
                    for p in group["params"]}
        pieces: dict[int, list[PieceView]] = {}
        for ref in self.stage.masters.piece_refs():
            pieces.setdefault(ref.param_index, []).append(PieceView(
                ref.param_begin, ref.piece.data, ref.piece, ref.optimizer, position[id(ref.optimizer)],
                group_of[id(ref.piece)]))
        views = []
        for index in sorted(pieces):
            ordered = sorted(pieces[index], key=lambda piece: piece.begin)
            slot = slots[index]
            views.append(TrainableView(slot.name, tuple(slot.shape), self.whole_tensor[ordered[0].optimizer_index],
                                       ordered))
        return views

    def frozen(self) -> list[FrozenView]:
        """Frozen parameters as this rank holds them: whole, or its part of those stage 3 shards."""
        sharded, parts = self.stage.frozen_parts()
        held = sharded | {id(p) for p in self.stage.flat.params}
        whole = [FrozenView(name, tuple(p.shape), 0, p.data, True) for name, p in self.module.named_parameters()
                 if id(p) not in held]
        return whole + parts

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Buffers the module's state_dict holds (not the non-persistent ones), by name."""
        return persistent_buffers(self.module)

    @contextmanager
    def resident(self, publish: bool = False) -> Iterator[None]:
        """Every piece's values and optimizer state in memory until exit (masters paged to NVMe are paged in);
        publish=True: what was written into them is published as a step publishes it."""
        with self.stage.masters.all_resident(publish=publish):
            yield

    def after_load(self) -> None:
        """What was written into the pieces and frozen parts becomes the model's parameters on every rank."""
        self.stage.after_load()

    def gather_groups(self) -> list[list[nn.Parameter]]:
        """The model's parameters in the groups that saving gathers together, in order: one unit's own at a time
        at stage 3, all at once below it (they are whole there)."""
        return [params for _, params in self.stage.saving_plan(self.module)]

    def gathered_in_turn(self) -> Iterator[list[nn.Parameter]]:
        """Each group of gather_groups(), in order, holding its full values until the next is asked for (every
        rank must go through all of them: at stage 3 each is a collective)."""
        for units, params in self.stage.saving_plan(self.module):
            with self.stage.gathered(units):
                yield params

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU in fp32 (parameters at their compute precision), gathered
        one unit at a time at stage 3 so the extra peak is the largest unit, not the model."""
        return full_state_dict_of(self)


def full_state_dict_of(view: Any) -> dict[str, torch.Tensor]:
    """What ParameterView.full_state_dict returns, for any view with a module and gathered_in_turn()."""
    names: dict[int, list[str]] = {}
    for name, param in view.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    state: dict[str, torch.Tensor] = {}
    with closing(view.gathered_in_turn()) as groups:  # an error inside releases the group it holds, now
        for params in groups:
            for param in params:
                for name in names[id(param)]:
                    state[name] = param.detach().float().cpu().clone()
    for name, buffer in persistent_buffers(view.module):
        state[name] = buffer.detach().cpu().clone()
    return {name: state[name] for name in view.module.state_dict(keep_vars=True)}  # the state dict's key order


class Place(NamedTuple):
    """Where a parameter of one stage sits in the model a checkpoint names (See PlacedView)."""

    name: str
    shape: tuple[int, ...]  # the whole parameter's
    offset: int  # the first element of this parameter within the whole one, flattened


class PlacedView:
    """A stage's trainable parameters named and placed as the model a checkpoint holds names them: each under its
    place's name and whole shape, its pieces' begins moved by the place's offset, the parameters of one name merged
    (split experts as the unsplit model's parameters: See [Note: split experts saved as the unsplit model's
    parameters] in zerokit/parallel/experts/names.py). `places`: by the stage's own name of each parameter."""

    def __init__(self, view: ParameterView, places: dict[str, Place]) -> None:
        self.view, self.places = view, places
        self.rank, self.world_size = view.rank, view.world_size  # in the stage's own group

    @property
    def replicated(self) -> bool:
        return self.view.replicated

    @property
    def writes_shards(self) -> bool:
        return self.view.writes_shards

    def trainable(self) -> list[TrainableView]:
        merged: dict[str, tuple[tuple[int, ...], list[PieceView]]] = {}
        for param in self.view.trainable():
            place = self.places[param.name]
            if param.whole_tensor:
                raise ValueError(f"{param.name}: its optimizer keeps state per whole tensor, which a checkpoint of "
                                 f"experts split over ranks cannot save as {place.name}'s; use an element-wise "
                                 "optimizer (Adam, SGD, ...) for the experts")
            pieces = [piece._replace(begin=piece.begin + place.offset) for piece in param.pieces]
            merged.setdefault(place.name, (place.shape, []))[1].extend(pieces)
        return [TrainableView(name, shape, False, sorted(pieces, key=lambda piece: piece.begin))
                for name, (shape, pieces) in merged.items()]


class SplitView:
    """What checkpoints and saves read of an engine whose experts are a stage of their own, seen as the model without
    expert parallelism (`module`, its experts stand-ins of their whole shapes): the dense stage's view (over a module
    without the experts), and the experts' placed as the unsplit model's (See PlacedView). Checkpoints save each
    section's parameters with the writers of its own group; frozen parameters and buffers are the dense view's.
    Saving whole weights gathers each whole expert parameter over the expert group into its stand-in, one at a time
    (See [Note: split experts gathered whole] in zerokit/parallel/experts/names.py)."""

    def __init__(self, dense: ParameterView, experts: PlacedView, module: nn.Module, group: Any) -> None:
        self.dense, self.experts, self.module, self.group = dense, experts, module, group
        self.rank, self.world_size = dense.rank, dense.world_size
        self.optimizers = dense.optimizers  # one optimizer steps both stages (share_optimizers)
        self.stand_ins = [(name, param) for name, param in module.named_parameters()
                          if name in {place.name for place in experts.places.values()}]

    @property
    def layout(self) -> FlatLayout:
        return self.dense.layout

    @property
    def replicated(self) -> bool:
        return self.dense.replicated

    @property
    def writes_shards(self) -> bool:
        return self.dense.writes_shards

    def sections(self) -> list[ParameterView | PlacedView]:
        return [self.dense, self.experts]

    def trainable(self) -> list[TrainableView]:
        return self.dense.trainable() + self.experts.trainable()

    def frozen(self) -> list[FrozenView]:
        return self.dense.frozen()

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return self.dense.buffers()

    @contextmanager
    def resident(self, publish: bool = False) -> Iterator[None]:
        with self.dense.resident(publish), self.experts.view.resident(publish):
            yield

    def after_load(self) -> None:
        self.dense.after_load()
        self.experts.view.after_load()

    def gather_groups(self) -> list[list[nn.Parameter]]:
        return self.dense.gather_groups() + [[param] for _, param in self.stand_ins]

    def gathered_in_turn(self) -> Iterator[list[nn.Parameter]]:
        """The dense groups as the dense view gathers them, then each whole expert parameter in its stand-in, held
        until the next is asked for (every rank must go through all of them)."""
        yield from self.dense.gathered_in_turn()
        local = self._local_experts()
        for name, stand_in in self.stand_ins:
            empty = stand_in.data
            stand_in.data = _whole(name, tuple(stand_in.shape), local.get(name, []), self.group)
            try:
                yield [stand_in]
            finally:
                stand_in.data = empty

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict_of(self)

    def _local_experts(self) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """This rank's pieces of each whole expert parameter, (offset, values) on the CPU, gathered one unit at a
        time at stage 3."""
        by_id = {id(param): name for name, param in self.experts.view.module.named_parameters()}
        local: dict[str, list[tuple[int, torch.Tensor]]] = {}
        with closing(self.experts.view.gathered_in_turn()) as groups:
            for params in groups:
                for param in params:
                    place = self.experts.places.get(by_id.get(id(param), ""))
                    if place is not None:
                        local.setdefault(place.name, []).append((place.offset, param.detach().cpu().clone()))
        return local


def _whole(name: str, shape: tuple[int, ...], pieces: list[tuple[int, torch.Tensor]], group: Any) -> torch.Tensor:
    """Parameter `name` whole, from every rank's pieces of it over `group` (each rank of an expert group holds other
    experts; together they hold each once)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, pieces, group=group)
    parts = [piece for ranks_pieces in gathered for piece in ranks_pieces]
    if not parts:
        raise RuntimeError(f"{name}: no rank of the expert group holds any of it (an internal bug)")
    whole = torch.empty(shape, dtype=parts[0][1].dtype)
    flat = whole.view(-1)
    for offset, values in parts:
        flat[offset:offset + values.numel()] = values.reshape(-1)
    return whole


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers the module's state_dict holds (not the non-persistent ones), by name."""
    keys = module.state_dict(keep_vars=True).keys()
    return [(name, buffer) for name, buffer in module.named_buffers() if name in keys]


__all__ = ["FrozenView", "ParameterView", "full_state_dict_of", "Place", "PlacedView", "PieceView", "SplitView",
           "TrainableView",
           "persistent_buffers"]
