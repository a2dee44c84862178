"""Stage 3: shard the parameters too. Each rank stores only its shard of every unit's parameters;
a unit is all-gathered right before it runs (forward, and again before its backward) and freed
right after, so full parameters exist only while the module that uses them computes.
Gradients are stage 2's (ShardedGradients), reduced on every micro-step. When units are gathered
and freed is hooks.py's business (See [Note: the stage-3 step] there), what that does unit_shards.py's.

[Note: frozen parameters at stage 3]
A frozen parameter (requires_grad=False) gets no gradient, no optimizer state and no reduction, but at
stage 3 it must not stay whole on every rank either: in a LoRA-style fine-tune the frozen base model
is nearly all of the weights. So each unit's frozen parameters are one more bucket of it, in a second
flat layout (one bucket per unit, compute dtype, padded to a multiple of N), of which each rank keeps
its 1/N shard: gathered and freed with the unit's trainable buckets (same gather process group, same
live-element count), released to the same NaN placeholder. Nothing ever updates the shard except
in-place edits kept by engine.unsharded(write_back=True).

Freeing in backward needs one more signal than a trainable unit does. A trainable unit is freed once
all its gradients are launched: a gradient is complete only after its parameter's last backward use.
A frozen weight has no gradient to tell us that, and its last backward use may come after every
trainable gradient of its unit is in (a frozen LayerNorm in front of trainable adapters: its backward,
which reads its weight, runs last in the unit). A frozen weight's backward is needed only to carry
gradients further back, towards the unit's inputs (a path to a trainable parameter of the same unit
ends in that parameter's gradient, which is waited for anyway). So a unit with frozen parameters is
freed in backward once its trainable gradients are all launched *and* the gradients of its forward
inputs that require grad are complete (tensor hooks registered in its pre-forward). Inputs that never
get a gradient leave the unit gathered until the end of backward, which frees every unit anyway.
Frozen parameters that are not floating point (integer codes, say) are left whole, as the cast to the
compute dtype leaves them at every stage.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerokit.comm import Communicator, ProcessGroups, Reduction
from zerokit.flat import Bucket, FlatParameters, ParamEntry, ShardedFlat, build_layout, tensor_bytes
from zerokit.masters import OptimizerPlan, ShardMasters
from zerokit.masters.state import masters_state_dict
from zerokit.tiers import ShardIO, master_homes, shard_home
from zerokit.tiers.swap import SwapDirectory
from zerokit.config.settings import EngineSettings, StageSettings
from zerokit.stages.agreement import GATHER
from zerokit.stages.base import param_entries, swap_directories_of, whole_tensor_owners
from zerokit.stages.construction import Construction, materialise
from zerokit.stages.hooks import TrainingState, UnitHooks
from zerokit.stages.stage2 import ShardedGradients
from zerokit.stages.unit_shards import UnitShards
from zerokit.stages.units import Unit, find_units
from zerokit.stages.view import FrozenView


class ShardedParameters(ShardedGradients):
    def __init__(self, flat: FlatParameters, masters: ShardMasters, groups: ProcessGroups, part: StageSettings,
                 settings: EngineSettings, shards: UnitShards) -> None:
        super().__init__(flat, masters, groups, part, settings)  # reduces every micro-step: parameters go after it
        self.shards = shards
        self.units, self.trainable, self.frozen = shards.units, shards.trainable, shards.frozen
        self.unit_hooks = UnitHooks(shards)
        agreement = shards.agreement
        if agreement is not None and agreement.mode == GATHER:  # See [Note: stage-3 units every rank agrees on]
            self.reductions_in_flight = len(self.layout.buckets)  # no cap's wait in backward
        for index in sorted(shards.persistent):
            shards.unshard(self.units[index])

    @classmethod
    def build(cls, model: nn.Module, params: list[nn.Parameter], groups: list[int], plan: OptimizerPlan,
              part: StageSettings, settings: EngineSettings, comm: Communicator,
              construction: Construction | None = None, held_elsewhere: frozenset[int] = frozenset()
              ) -> "ShardedParameters":
        """Units, then their layouts (one bucket per unit and param group; frozen: one per unit), then the
        shards and the masters, then each unit's values placed, unit by unit (See `_place`). `held_elsewhere`: ids of
        parameters another stage holds (MoE experts split over ranks: See [Note: ZeRO over experts split across
        ranks] in zerokit/parallel/experts/share.py), neither trainable nor frozen here."""
        process_groups = ProcessGroups.for_stage(comm, settings)
        global_rank, comm = comm.rank, process_groups.shard  # See [Note: hybrid sharding] in comm/groups.py
        units = find_units(model, part.units, held_elsewhere)
        unit_of = {param_id: unit.index for unit in units for param_id in unit.param_ids}
        per_unit = max(groups, default=0) + 1
        keys = [unit_of[id(p)] * per_unit + g for p, g in zip(params, groups)]
        owners = whole_tensor_owners(params, groups, plan, comm.world_size)
        layout = build_layout(param_entries(model, params, keys, owners), comm.world_size, bucket_numel=sys.maxsize)
        dtype, device = part.param_dtype, _device_of(model)
        home = shard_home(part.offload, comm.stats, device, global_rank)
        node = process_groups.node  # See [Note: hpZ's secondary copy] in flat/sharded.py
        trainable = ShardedFlat(FlatParameters(params, layout, dtype), comm.rank, home, node,
                                shard_dtype=_trainable_shard_dtype(part, home))
        frozen = ShardedFlat(_frozen_flat(model, params, unit_of, comm.world_size, dtype, held_elsewhere),
                             comm.rank, home, node)
        shards = UnitShards(units, trainable, frozen, [b.group // per_unit for b in layout.buckets],
                            process_groups.gather, part.units)
        homes = master_homes([trainable.shard(b) for b in layout.buckets], part.offload, comm.stats, device,
                             global_rank, home, plan.names)
        masters = ShardMasters(homes, [b.param_slices(comm.rank) for b in layout.buckets],
                               [groups[b.slots[0].param_index] for b in layout.buckets], plan, part.sub_group_size)
        _place(model, shards, masters, comm, construction or Construction())
        return cls(trainable.flat, masters, process_groups, part, settings, shards)

    # --- gradients, step -----------------------------------------------------------------------------
    def reduce_bucket(self, bucket: Bucket) -> Reduction:
        reduction = super().reduce_bucket(bucket)
        self.unit_hooks.bucket_launched(bucket)
        return reduction

    def install_module_hooks(self, release_reductions: Callable[[], None]) -> list[RemovableHandle]:
        """The units' forward hooks; a rank that leaves the backward's agreed order releases the reducer's
        remaining reductions (See [Note: stage-3 units every rank agrees on] in stages/agreement.py)."""
        if self.shards.agreement is not None and self.shards.agreement.mode != GATHER:
            self.shards.agreement.connect(release_reductions)
        return self.unit_hooks.install()

    def end_of_autograd(self) -> None:
        self.unit_hooks.end_of_autograd()

    def finish_backward(self) -> None:
        self.unit_hooks.finish_backward()
        super().finish_backward()  # with MiCS: the boundary's average across replicas

    def recomputed_modules(self) -> list[nn.Module]:
        """With checkpoint_units, every unit but the root (which is the whole model)."""
        return [unit.module for unit in self.units[1:]] if self.part.checkpoint_units else []

    def publish_params(self) -> None:
        """Masters -> shards; units that stay gathered (persistent, or all while pinned) are re-gathered (from the
        new shards: hpZ's secondary copy is dropped first)."""
        self.shards.drop_secondary()
        self.masters.publish()
        self.shards.refresh_gathered()

    def after_load(self) -> None:
        """Published, and the frozen buckets of units kept gathered gathered again from their loaded shards."""
        self.publish_params()  # drops hpZ's secondary copy: it held the values from before the load
        for bucket in self.frozen.layout.buckets:
            self.frozen.regather(bucket, self.shards.comm)

    def frozen_parts(self) -> tuple[set[int], list[FrozenView]]:
        """The frozen parameters sharded by unit, and this rank's part of each, a view of its unit's frozen shard
        (See [Note: frozen parameters at stage 3]); a rank may hold no part of a small one."""
        parts = []
        for bucket in self.frozen.layout.buckets:
            slots = {slot.param_index: slot for slot in bucket.slots}
            shard = self.frozen.shard(bucket)
            for part in bucket.param_slices(self.rank):
                slot = slots[part.param_index]
                parts.append(FrozenView(slot.name, slot.shape, part.param_begin, shard[part.begin:part.end], False))
        return {id(param) for param in self.frozen.flat.params}, parts

    def write_back_params(self) -> None:
        """The user changed gathered parameters in place: keep this rank's slice of each, in the shard
        and in the fp32 master (frozen ones: in their shard); hpZ's secondary copy goes."""
        self.shards.drop_secondary()
        self.shards.write_back()
        self.masters.write_back()

    # --- what it holds -------------------------------------------------------------------------------
    def parameter_bytes(self) -> dict[str, int]:
        """The shards where their home keeps them, and the gathered buckets on the device."""
        return self.trainable.held_by_tier()

    def frozen_bytes(self, model: nn.Module) -> dict[str, int]:
        """Frozen shards, the frozen buckets of gathered units, and whatever frozen parameters stay whole
        (on the device). (A released parameter's numel * element_size would count its full size: it holds
        one element.)"""
        sharded = {id(p) for p in self.frozen.flat.params} | {id(p) for p in self.flat.params}
        held = self.frozen.held_by_tier()
        held["device"] = held.get("device", 0) + tensor_bytes(p for p in model.parameters() if id(p) not in sharded)
        return held

    def state_dict(self) -> dict[str, Any]:
        """The masters and the optimizer, and the frozen shards (nothing else holds them); the trainable
        shards are the masters in the compute dtype."""
        return {"masters": masters_state_dict(self.masters), "frozen": self.frozen.shards.detach()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.frozen.shards.copy_(state["frozen"])
        super().load_state_dict(state)

    def swap_directories(self) -> list[SwapDirectory]:
        """The masters' and, with offload_param.device=nvme, the parameter shards'."""
        return swap_directories_of([*self.masters.homes, self.trainable.home])

    def bucket_purpose(self, bucket: Bucket) -> str:
        return f"gradients of unit {self.units[self.shards.unit_of_bucket[bucket.index]].name!r}: bucket {bucket.index}"

    def describe(self) -> list[str]:
        sizes = self.shards.gathered_numel
        return [*super().describe(),
                f"stage 3: {len(self.units)} units ({len(self.units) - 1} besides the root); gathered, the root holds "
                f"{sizes[0]:,} elements and the largest other unit {max(sizes[1:], default=0):,}; "
                f"{len(self.shards.persistent)} persistent", *self.shards.live_limit_lines(), *self._hpz_lines()]

    def _hpz_lines(self) -> list[str]:
        node = self.groups.node
        if node is None:
            return []
        return [f"hpZ: a secondary copy of the parameter shards over groups of {node.world_size} consecutive ranks; "
                "each unit's first gather of a step reads the primary shards, every later one the secondary copy"]

    # --- access between steps ----------------------------------------------------------------------
    @contextmanager
    def gathered(self, units: list[Unit] | None = None, write_back: bool = False) -> Iterator[None]:
        """`units` (default: all) gathered until exit, for inference or to read or edit full weights."""
        hooks = self.unit_hooks
        if hooks.state not in (TrainingState.IDLE, TrainingState.PINNED):
            raise RuntimeError("gather parameters between steps, not inside forward or backward")
        outer = hooks.state == TrainingState.PINNED
        for unit in units or self.units:
            self.shards.unshard(unit)
        hooks.state = TrainingState.PINNED
        try:
            yield
        finally:
            if write_back:
                self.write_back_params()
            if not outer:
                hooks.state = TrainingState.IDLE
                for unit in units or self.units:
                    self.shards.reshard(unit)

    def saving_plan(self, model: nn.Module) -> list[tuple[list[Unit], list[nn.Parameter]]]:
        """One unit at a time: saving never holds more than one unit's full parameters (an outer unit's
        own, without the units inside it: units never share a parameter)."""
        return [([unit], [p for p in model.parameters() if id(p) in unit.param_ids]) for unit in self.units]

    def units_of(self, params: list[nn.Parameter]) -> list[Unit]:
        wanted = {id(p) for p in params}
        return [unit for unit in self.units if unit.param_ids & wanted]


def _trainable_shard_dtype(part: StageSettings, home: ShardIO) -> torch.dtype:
    """fp32 where the shards can be the masters: a 16-bit compute dtype, with the shards and the optimizer on the
    device (See [Note: the shard is the fp32 master] in zerokit/flat/sharded.py); else the compute dtype."""
    on_device = home.tier == "device" and not part.offload.optimizer.enabled
    return torch.float32 if on_device else part.param_dtype


def _device_of(model: nn.Module) -> torch.device:
    """The device the model computes on (the engine moved it there)."""
    return next(model.parameters(), torch.empty(0)).device


def _frozen_flat(model: nn.Module, trainable: list[nn.Parameter], unit_of: dict[int, int], world_size: int,
                 dtype: torch.dtype, held_elsewhere: frozenset[int]) -> FlatParameters:
    """Each unit's floating-point frozen parameters (not trainable, not held by another stage), in model order, as one
    bucket per unit (keyed by the unit's index). See [Note: frozen parameters at stage 3]."""
    is_trainable = {id(p) for p in trainable} | held_elsewhere
    names = {id(p): name for name, p in model.named_parameters()}
    frozen = [p for p in model.parameters() if id(p) not in is_trainable and p.is_floating_point()]
    entries = [ParamEntry(p.numel(), unit_of[id(p)], names[id(p)], tuple(p.shape)) for p in frozen]  # sharded evenly
    return FlatParameters(frozen, build_layout(entries, world_size, bucket_numel=sys.maxsize), dtype)


def _place(model: nn.Module, shards: UnitShards, masters: ShardMasters, comm: Communicator,
           construction: Construction) -> None:
    """Unit by unit, bucket by bucket: keep this rank's shard and fp32 master (of frozen parameters: the
    shard), free the rest. The peak is one bucket in fp32, and a model built on the meta device is
    materialised here, one unit at a time (See [Note: sharded construction] in construction.py)."""
    for unit in shards.units:
        materialise(model, unit.param_ids, construction)
        for flat, bucket in shards.parts(unit):
            values = flat.flat.pack_bucket(bucket)  # 1-D fp32, the whole bucket; dropped on return
            if construction.verify:
                _check_identical_across_ranks(comm, unit, values)
            own = flat.keep_shard(bucket, values)
            if flat is shards.trainable:
                masters.initialise(bucket.index, own)
        for flat, bucket in shards.parts(unit):
            flat.release(bucket)


def _check_identical_across_ranks(comm: Communicator, unit: Unit, values: torch.Tensor) -> None:
    checksum = values.double().sum()
    extremes = torch.stack([checksum, -checksum])
    comm.all_reduce(extremes, op=dist.ReduceOp.MAX, purpose=f"initialisation check of unit {unit.name!r}")
    if extremes[0] != -extremes[1]:
        raise ValueError(f"rank {comm.rank}: unit {unit.name!r} was initialised differently on different ranks; "
                         "seed every rank identically or load the same weights in param_init")
