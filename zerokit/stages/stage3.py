"""Stage 3: shard the parameters too. Each rank stores only its shard of every unit's parameters;
a unit is all-gathered right before it runs (forward, and again before its backward) and freed
right after, so full parameters exist only while the module that uses them computes.

[Note: the stage-3 step]
  root pre-forward: gather the root unit (kept for the whole step; it owns the tied weights)
  unit pre-forward: gather it (or wait for its prefetch), prefetch the next unit in last step's order
  unit post-forward: free it; hook its outputs so that their gradient re-gathers it
  unit pre-backward (output gradient ready): gather it, prefetch the unit whose output came just before
    its own in this forward (backward reaches units in the reverse of the order their outputs came in)
  gradients ready: stage 2's buckets (one per unit and param group) reduce-scatter them; once all of a
    unit's buckets are launched the unit is freed again
  end of backward: free whatever is still gathered
The gathers run on their own process group: see Communicator.twin for why. A unit's frozen parameters
are sharded, gathered and freed with it; freeing one in backward also waits for its inputs' gradients:
see [Note: frozen parameters at stage 3] in frozen.py.

[Note: hooks around nested units]
With nested units (See [Note: nested units] in units.py) an inner unit's hooks fire inside its outer
unit's forward. Nothing above needs a special case, for these reasons:
  - forward: the outer unit is gathered in its pre-forward and freed in its post-forward, which comes
    after the inner unit's post-forward; the inner unit gathers and frees only what it owns. Pre-forward
    order (outer, inner, next outer, ...) is the order units are needed in, so it drives prefetch.
  - backward: the outer unit's output gradient is ready before any backward inside the outer unit runs,
    so the outer unit is gathered first. Output order (inner, outer, next inner, ...) reversed is the
    order backward reaches units in, so the unit to prefetch is the one whose output came just before:
    never a unit around this one, which may already be freed for good.
  - freeing in backward: a unit is freed once its own gradients are all launched. A gradient is complete
    only after the last backward use of its parameter, and the weights an outer unit shares with an
    inner one belong to the outer one, so no unit is freed while backward still needs what it owns.
    (A unit with frozen parameters also waits for its inputs' gradients: frozen weights have no
    gradient to say they are done.)
  - activation checkpointing recomputes an outer unit's forward in backward: the inner units it calls
    are gathered there (state BACKWARD: nothing is freed), and their own pre-backward finds them gathered.
Live at once: the root, persistent units, a whole chain of nested units, and one unit before it whose
last gradients may still be accumulating; see _check_live_limit. Prefetches come on top only if they fit.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from enum import Enum, auto
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from zerokit.comm import Pending, wait
from zerokit.flat import Bucket
from zerokit.stages.base import BucketReduction, copy_edits, tensor_bytes
from zerokit.stages.construction import ParamInit, materialise, reset_parameters
from zerokit.stages.frozen import FrozenShards
from zerokit.stages.stage2 import ShardedGradients
from zerokit.stages.units import Unit, ancestry, find_units


class TrainingState(Enum):
    IDLE = auto()  # between steps: only the persistent units are gathered
    FORWARD = auto()  # in forward: units are gathered before they run and freed after
    BACKWARD = auto()  # in backward: units are re-gathered before their backward, freed once reduced
    PINNED = auto()  # in engine.unsharded(): every unit stays gathered


class ShardedParameters(ShardedGradients):
    def __init__(self, model: nn.Module, *args: Any, param_init: ParamInit | None = None,
                 pending_init: set[int] | None = None, **kwargs: Any) -> None:
        """`pending_init`: ids of parameters that came from the meta device and still need `param_init`."""
        self.model = model
        self.pending_init = pending_init or set()
        self.verify_init = bool(self.pending_init)
        self.param_init = param_init or reset_parameters
        super().__init__(model, *args, **kwargs)

    def bucket_keys(self, model: nn.Module, params: list[nn.Parameter], groups: list[int]) -> tuple[list[int], int]:
        """One bucket per (unit, optimizer param group): a unit's gradients are reduced together."""
        self.units: list[Unit] = find_units(model, self.config.stage3)
        unit_of = {param_id: unit.index for unit in self.units for param_id in unit.param_ids}
        self.groups_per_unit = max(groups, default=0) + 1
        return [unit_of[id(p)] * self.groups_per_unit + g for p, g in zip(params, groups)], sys.maxsize

    def place_parameters(self) -> list[nn.Parameter]:
        """Unit by unit, bucket by bucket: keep this rank's shard and fp32 master (of frozen parameters:
        the shard), free the rest. The peak is one bucket in fp32, and a model built on the meta device
        is materialised here, one unit at a time (See [Note: sharded construction])."""
        self.reduces_every_micro_step = True
        self.gather_comm = self.comm.twin()
        self.unit_buckets: list[list[Bucket]] = [[] for _ in self.units]
        for bucket in self.layout.buckets:
            self.unit_buckets[bucket.group // self.groups_per_unit].append(bucket)
        self.unit_numel = [sum(b.numel for b in buckets) for buckets in self.unit_buckets]  # trainable, padded
        self.frozen = self._frozen_by_unit()  # unit index -> its frozen parameters' shard
        # Elements a unit holds while gathered: its trainable buckets and its frozen buffer, padded.
        self.gathered_numel = [self.unit_numel[u.index] + (self.frozen[u.index].numel if u.index in self.frozen else 0)
                               for u in self.units]
        # 1-D, param dtype: this rank's shard of every bucket, back to back (bucket b at b.start / N).
        self.shards = torch.empty(self.layout.shard_numel, dtype=self.flat.dtype, device=self.flat.device)
        self.placeholder = torch.full((1,), float("nan"), dtype=self.flat.dtype, device=self.flat.device)
        masters: dict[int, nn.Parameter] = {}
        for unit in self.units:
            materialise(self.model, unit.param_ids, self.pending_init, self.param_init)
            for bucket in self.unit_buckets[unit.index]:
                masters[bucket.index] = self._shard_bucket(unit, bucket)
            if unit.index in self.frozen:
                self._shard_frozen(unit)
            self._release_params(unit)
        self._init_runtime_state()
        return [masters[bucket.index] for bucket in self.layout.buckets]

    def _frozen_by_unit(self) -> dict[int, FrozenShards]:
        """Each unit's floating-point frozen parameters, in model order, as one sharded buffer per unit
        (See [Note: frozen parameters at stage 3]). Other frozen parameters stay whole."""
        trainable = {id(p) for p in self.flat.params}
        unit_of = {param_id: unit.index for unit in self.units for param_id in unit.param_ids}
        by_unit: dict[int, list[nn.Parameter]] = {}
        for param in self.model.parameters():
            if id(param) not in trainable and param.is_floating_point():
                by_unit.setdefault(unit_of[id(param)], []).append(param)
        return {index: FrozenShards(params, self.rank, self.world_size, self.flat.dtype)
                for index, params in by_unit.items()}

    def _shard_frozen(self, unit: Unit) -> None:
        values = self.frozen[unit.index].pack()  # 1-D fp32, the unit's frozen parameters; dropped on return
        if self.verify_init:
            self._check_identical_across_ranks(unit, values)

    def _shard_bucket(self, unit: Unit, bucket: Bucket) -> nn.Parameter:
        full = torch.zeros(bucket.numel, dtype=torch.float32, device=self.flat.device)  # 1-D, this bucket
        for slot in bucket.slots:
            begin = slot.offset - bucket.start
            full[begin:begin + slot.numel].copy_(self.flat.params[slot.param_index].data.reshape(-1))
        if self.verify_init:
            self._check_identical_across_ranks(unit, full)
        own = full[self.rank * bucket.shard_numel:(self.rank + 1) * bucket.shard_numel]
        shard = self._shard(bucket)
        shard.copy_(own)
        return nn.Parameter(own.clone() if self.separate_masters else shard)  # fp32: step the shard itself

    def _check_identical_across_ranks(self, unit: Unit, values: torch.Tensor) -> None:
        checksum = values.double().sum()
        extremes = torch.stack([checksum, -checksum])
        self.comm.all_reduce(extremes, op=dist.ReduceOp.MAX)
        if extremes[0] != -extremes[1]:
            raise ValueError(f"rank {self.rank}: unit {unit.name!r} was initialised differently on different ranks; "
                             "seed every rank identically or load the same weights in param_init")

    def _init_runtime_state(self) -> None:
        self.full: dict[int, torch.Tensor] = {}  # bucket index -> gathered bucket (1-D, param dtype)
        self.in_flight: dict[int, Pending] = {}
        self.live_numel = self.peak_live_numel = 0
        policy = self.config.stage3
        self.persistent = {u.index for u in self.units
                           if 0 < self.gathered_numel[u.index] < policy.persistence_threshold}
        self._check_live_limit()
        self.state = TrainingState.IDLE
        self.forward_order: list[int] = []  # unit indices in pre-forward order, this forward
        self.last_forward_order: list[int] = []  # the same, last forward: what prefetch expects next
        self.output_order: list[int] = []  # unit indices in post-forward order: backward runs it in reverse
        self.reduced: set[int] = set()
        # unit index -> gradients of its forward inputs still to come, this backward (units with frozen
        # parameters only: See [Note: frozen parameters at stage 3])
        self.awaiting_inputs: dict[int, int] = {}
        for unit in self.units:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True)
            unit.module.register_forward_hook(partial(self._post_forward, unit))
        for index in sorted(self.persistent):
            self.unshard(self.units[index])

    def _check_live_limit(self) -> None:
        """Root and persistent units stay gathered. Besides them, at worst the unit computing is live with
        every unit around it (a chain of nested units; just the unit itself without nesting), plus one
        other unit whose last gradients are not all in yet: two units when none nest. Prefetches are
        not counted: they wait when they would not fit. A unit's size counts its frozen parameters too.
        See [Note: hooks around nested units]."""
        size = self.gathered_numel
        sharded = {i for i in range(1, len(self.units)) if i not in self.persistent}
        largest_first = sorted(sharded, key=lambda i: -size[i])
        worst = 0
        for index in sharded:
            chain = {j for j in ancestry(self.units, index) if j in sharded}
            other = next((size[k] for k in largest_first if k not in chain), 0)
            worst = max(worst, sum(size[j] for j in chain) + other)
        needed = size[0] + sum(size[i] for i in self.persistent if i) + worst
        limit = self.config.stage3.max_live_parameters
        if needed > limit:
            raise ValueError(f"stage3_max_live_parameters={limit} is below the {needed} elements this model needs "
                             "live at once (root + persistent units + the largest chain of nested units + one "
                             "more unit); raise it or use smaller units (stage3_unit_classes)")

    # --- gather and free ---------------------------------------------------------------------------
    def _shard(self, bucket: Bucket) -> torch.Tensor:
        begin = bucket.start // self.world_size
        return self.shards[begin:begin + bucket.shard_numel]

    def is_gathered(self, unit: Unit) -> bool:
        frozen = self.frozen.get(unit.index)
        return (frozen is None or frozen.ready) and all(
            b.index in self.full and b.index not in self.in_flight for b in self.unit_buckets[unit.index])

    def _any_gathered(self, unit: Unit) -> bool:
        """Some of the unit is gathered or on its way (a prefetch was launched)."""
        frozen = self.frozen.get(unit.index)
        return (frozen is not None and frozen.gathered) or any(
            b.index in self.full for b in self.unit_buckets[unit.index])

    def unshard(self, unit: Unit, async_op: bool = False) -> None:
        for bucket in self.unit_buckets[unit.index]:
            if bucket.index in self.full:
                continue
            self._count_live(unit, bucket.numel, async_op)
            full = torch.empty(bucket.numel, dtype=self.flat.dtype, device=self.flat.device)
            self.in_flight[bucket.index] = self.gather_comm.all_gather(full, self._shard(bucket), async_op=True)
            self.full[bucket.index] = full
        frozen = self.frozen.get(unit.index)
        if frozen is not None and not frozen.gathered:
            self._count_live(unit, frozen.numel, async_op)
            frozen.gather(self.gather_comm)
        if not async_op:
            for bucket in self.unit_buckets[unit.index]:
                if bucket.index in self.in_flight:
                    wait(self.in_flight.pop(bucket.index))
            if frozen is not None:
                frozen.wait()
            self._point_params(unit)

    def _count_live(self, unit: Unit, numel: int, async_op: bool) -> None:
        """`numel` more unsharded elements; a gather that must happen now may not break the limit
        (a prefetch was checked against it before it was asked for)."""
        limit = self.config.stage3.max_live_parameters
        if not async_op and self.live_numel + numel > limit:
            raise RuntimeError(f"rank {self.rank}: gathering unit {unit.name!r} would hold "
                               f"{self.live_numel + numel} unsharded elements, over "
                               f"stage3_max_live_parameters={limit}")
        self.live_numel += numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def reshard(self, unit: Unit) -> None:
        if unit.index in self.persistent or self.state == TrainingState.PINNED:
            return
        for bucket in self.unit_buckets[unit.index]:
            if bucket.index in self.in_flight:
                wait(self.in_flight.pop(bucket.index))
            if self.full.pop(bucket.index, None) is not None:
                self.live_numel -= bucket.numel
        if unit.index in self.frozen:
            self.live_numel -= self.frozen[unit.index].free()
        self._release_params(unit)

    def _point_params(self, unit: Unit) -> None:
        for bucket in self.unit_buckets[unit.index]:
            full = self.full[bucket.index]
            for slot in bucket.slots:
                param = self.flat.params[slot.param_index]
                begin = slot.offset - bucket.start
                param.data = full[begin:begin + slot.numel].view(param.shape)
        if unit.index in self.frozen:
            self.frozen[unit.index].point()

    def _release_params(self, unit: Unit) -> None:
        """A sharded parameter keeps its true shape and dtype (no torch.Size([0]) surprise): its data is
        one NaN broadcast to that shape, so code that computes with it outside its unit's forward gets
        NaN (and zerokit skips and reports the step) rather than plausible zeros, and code that writes to
        it in place gets an error. Gather with engine.unsharded() first."""
        for bucket in self.unit_buckets[unit.index]:
            for slot in bucket.slots:
                param = self.flat.params[slot.param_index]
                param.data = self.placeholder.expand(param.shape)
        if unit.index in self.frozen:
            self.frozen[unit.index].release_params(self.placeholder)

    def _prefetch(self, unit_index: int | None) -> None:
        if unit_index is None:
            return
        unit = self.units[unit_index]
        numel = self.gathered_numel[unit_index]
        fits = self.live_numel + numel <= self.config.stage3.max_live_parameters
        if fits and numel <= self.config.stage3.prefetch_numel and not self._any_gathered(unit):
            self.unshard(unit, async_op=True)

    # --- hooks ---------------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if unit.index == 0 and self.state in (TrainingState.IDLE, TrainingState.FORWARD):
            self.state = TrainingState.FORWARD
            self.forward_order, self.output_order = [], []
            self.awaiting_inputs.clear()
        if self.state == TrainingState.FORWARD:
            self.forward_order.append(unit.index)
            if unit.index in self.frozen and unit.index and torch.is_grad_enabled():
                self._hook_inputs(unit, (args, kwargs))
        self.unshard(unit)
        if self.state == TrainingState.FORWARD:
            self._prefetch(_neighbour(self.last_forward_order, unit.index, +1))

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self.state == TrainingState.FORWARD:
            self.output_order.append(unit.index)
        if self.state == TrainingState.FORWARD and unit.index != 0:
            self.reshard(unit)  # only what it owns: a unit around it stays gathered until its own post-forward
        if unit.index == 0 and self.state == TrainingState.FORWARD:
            self.last_forward_order = self.forward_order
            if not torch.is_grad_enabled():  # no backward will follow (eval, generation)
                self.reshard(unit)
                self.state = TrainingState.IDLE
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._pre_backward, unit))

    def _hook_inputs(self, unit: Unit, inputs: Any) -> None:
        """Count the inputs whose gradients must be in before the unit's frozen weights may go. Only in
        the real forward: a recomputation's tensors (activation checkpointing) are not on backward's path."""
        needing_grad = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        self.awaiting_inputs[unit.index] = self.awaiting_inputs.get(unit.index, 0) + len(needing_grad)
        for tensor in needing_grad:
            tensor.register_hook(partial(self._input_grad_ready, unit))

    def _input_grad_ready(self, unit: Unit, grad: torch.Tensor) -> None:
        # .get: a hook of an earlier forward whose backward never ran may fire after the count was reset
        self.awaiting_inputs[unit.index] = self.awaiting_inputs.get(unit.index, 0) - 1
        if self.state == TrainingState.BACKWARD:
            self._reshard_if_done(unit)

    def _reshard_if_done(self, unit: Unit) -> None:
        """In backward: free a unit once its gradients are launched and, if it has frozen parameters, its
        inputs' gradients are in (See [Note: frozen parameters at stage 3]). The root stays to the end."""
        if unit.index and self.awaiting_inputs.get(unit.index, 0) <= 0 and all(
                b.index in self.reduced for b in self.unit_buckets[unit.index]):
            self.reshard(unit)

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        if self.state == TrainingState.PINNED:
            return
        self.state = TrainingState.BACKWARD
        if not self.is_gathered(unit):
            self.unshard(unit)
        # See [Note: hooks around nested units]
        self._prefetch(_neighbour(self.output_order, unit.index, -1))

    # --- gradients, step -----------------------------------------------------------------------------
    def reduce_bucket(self, bucket: Bucket) -> BucketReduction:
        reduction = super().reduce_bucket(bucket)
        self.reduced.add(bucket.index)
        # Its gradients are staged and on their way: the full parameters can go.
        self._reshard_if_done(self.units[bucket.group // self.groups_per_unit])
        return reduction

    def finish_backward(self) -> None:
        self.reduced.clear()
        self.awaiting_inputs.clear()
        if self.state != TrainingState.PINNED:
            for unit in self.units:
                self.reshard(unit)
            self.state = TrainingState.IDLE

    def publish_params(self) -> None:
        """Masters -> shards; units that stay gathered (persistent, or all while pinned) are re-gathered."""
        if self.separate_masters:
            for bucket, master in zip(self.layout.buckets, self.masters):
                self._shard(bucket).copy_(master.detach())
        for bucket in self.layout.buckets:
            if bucket.index in self.full:
                wait(self.gather_comm.all_gather(self.full[bucket.index], self._shard(bucket)))

    def write_back_params(self) -> None:
        """The user changed gathered parameters in place: keep this rank's slice of each, in the shard
        and in the fp32 master (frozen ones: in their shard)."""
        for frozen in self.frozen.values():
            frozen.write_back()
        for bucket, master in zip(self.layout.buckets, self.masters):
            if bucket.index in self.full:
                own = self.full[bucket.index][self.rank * bucket.shard_numel:(self.rank + 1) * bucket.shard_numel]
                self._shard(bucket).copy_(own)
                if self.separate_masters:
                    copy_edits(master.data, own)

    def memory_by_category(self) -> dict[str, int]:
        stats = super().memory_by_category()
        stats["parameters"] = tensor_bytes([self.shards, *self.full.values()])
        return stats

    def frozen_bytes(self, model: nn.Module) -> int:
        """Frozen shards, the frozen buffers of gathered units, and whatever frozen parameters stay whole.
        (A released parameter's numel * element_size would count its full size: it holds one element.)"""
        sharded = {id(p) for frozen in self.frozen.values() for p in frozen.params}
        trainable = {id(p) for p in self.flat.params}
        whole = [p for p in model.parameters() if id(p) not in sharded and id(p) not in trainable]
        return tensor_bytes(t for frozen in self.frozen.values() for t in frozen.tensors()) + tensor_bytes(whole)

    @contextmanager
    def gathered(self, units: list[Unit] | None = None, write_back: bool = False) -> Iterator[None]:
        """`units` (default: all) gathered until exit, for inference or to read or edit full weights."""
        if self.state not in (TrainingState.IDLE, TrainingState.PINNED):
            raise RuntimeError("gather parameters between steps, not inside forward or backward")
        outer = self.state == TrainingState.PINNED
        for unit in units or self.units:
            self.unshard(unit)
        self.state = TrainingState.PINNED
        try:
            yield
        finally:
            if write_back:
                self.write_back_params()
            if not outer:
                self.state = TrainingState.IDLE
                for unit in units or self.units:
                    self.reshard(unit)

    def saving_plan(self, model: nn.Module) -> list[tuple[list[Unit], list[nn.Parameter]]]:
        """One unit at a time: saving never holds more than one unit's full parameters (an outer unit's
        own, without the units inside it: units never share a parameter)."""
        return [([unit], [p for p in model.parameters() if id(p) in unit.param_ids]) for unit in self.units]

    def units_of(self, params: list[nn.Parameter]) -> list[Unit]:
        wanted = {id(p) for p in params}
        return [unit for unit in self.units if unit.param_ids & wanted]


def _neighbour(order: list[int], unit_index: int, step: int) -> int | None:
    """The unit next to (the last call of) unit_index in a recorded order; None off either end."""
    if unit_index not in order:
        return None
    position = len(order) - 1 - order[::-1].index(unit_index) + step
    return order[position] if 0 <= position < len(order) and order[position] != unit_index else None
