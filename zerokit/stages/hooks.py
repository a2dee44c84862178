"""Every hook zerokit puts into the user's model, in one place, and stage 3's state machine that they
drive: *when* units are gathered, freed and prefetched (*what* that does is in unit_shards.py).

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
see [Note: frozen parameters at stage 3] in stage3.py.

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
last gradients may still be accumulating; see UnitShards._needed_live_numel. Prefetches come on top only
if they fit.
"""

from __future__ import annotations

from enum import Enum, auto
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from zerokit.flat import Bucket
from zerokit.stages.unit_shards import UnitShards
from zerokit.stages.units import Unit

if TYPE_CHECKING:
    from zerokit.stages.base import ZeroStage
    from zerokit.stages.reducer import BucketReducer


def install_hooks(stage: "ZeroStage", reducer: "BucketReducer") -> list[RemovableHandle]:
    """Gradient-ready hooks on every trainable parameter (they drive the bucket reducer) and, at stage 3,
    the units' forward hooks. Returns the handles, so that they can be removed."""
    handles = [param.register_post_accumulate_grad_hook(partial(_grad_ready, reducer, index))
               for index, param in enumerate(stage.flat.params)]
    return handles + stage.install_module_hooks(reducer.launch_remaining)


def _grad_ready(reducer: "BucketReducer", index: int, param: torch.Tensor) -> None:
    reducer.grad_arrived(index)


class TrainingState(Enum):
    IDLE = auto()  # between steps: only the persistent units are gathered
    FORWARD = auto()  # in forward: units are gathered before they run and freed after
    BACKWARD = auto()  # in backward: units are re-gathered before their backward, freed once reduced
    PINNED = auto()  # in engine.unsharded(): every unit stays gathered


class UnitHooks:
    """Stage 3's hook state machine. See [Note: the stage-3 step]."""

    def __init__(self, shards: UnitShards) -> None:
        self.shards = shards
        self.units = shards.units
        self.state = TrainingState.IDLE
        self.forward_order: list[int] = []  # unit indices in pre-forward order, this forward
        self.last_forward_order: list[int] = []  # the same, last forward: what prefetch expects next
        self.output_order: list[int] = []  # unit indices in post-forward order: backward runs it in reverse
        self.reduced: set[int] = set()  # trainable buckets launched for reduction, this backward
        # unit index -> gradients of its forward inputs still to come, this backward (units with frozen
        # parameters only: See [Note: frozen parameters at stage 3] in stage3.py)
        self.awaiting_inputs: dict[int, int] = {}

    def install(self) -> list[RemovableHandle]:
        handles = []
        for unit in self.units:
            # eager even inside torch.compile'd code: See [Note: torch.compile and zerokit's hooks] in
            # reliability/compiled.py
            pre, post = partial(self._pre_forward, unit), partial(self._post_forward, unit)
            handles.append(unit.module.register_forward_pre_hook(torch.compiler.disable(pre), with_kwargs=True))
            handles.append(unit.module.register_forward_hook(torch.compiler.disable(post)))
        return handles

    # --- forward ------------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if unit.index == 0 and self.state in (TrainingState.IDLE, TrainingState.FORWARD):
            self.state = TrainingState.FORWARD
            self.shards.set_phase("forward")
            self.forward_order, self.output_order = [], []
            self.awaiting_inputs.clear()
        if self.state == TrainingState.FORWARD:
            self.forward_order.append(unit.index)
            if unit.index in self.shards.frozen_of and unit.index and torch.is_grad_enabled():
                self._hook_inputs(unit, (args, kwargs))
        self.shards.unshard(unit)
        if self.state == TrainingState.FORWARD:
            self.shards.prefetch(_neighbour(self.last_forward_order, unit.index, +1))

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self.state == TrainingState.FORWARD:
            self.output_order.append(unit.index)
            if unit.index != 0:
                self.shards.reshard(unit)  # only what it owns: a unit around it stays until its own post-forward
            else:
                self.last_forward_order = self.forward_order
                self.shards.end_phase()  # See [Note: stage-3 units every rank agrees on] in stages/agreement.py
                if not torch.is_grad_enabled():  # no backward will follow (eval, generation)
                    self.shards.reshard(unit)
                    self.state = TrainingState.IDLE
                    self.shards.set_phase("between steps")
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

    # --- backward -----------------------------------------------------------------------------------
    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        if self.state == TrainingState.PINNED:
            return
        self.state = TrainingState.BACKWARD
        self.shards.set_phase("backward")
        if not self.shards.is_gathered(unit):
            self.shards.unshard(unit)
        # See [Note: hooks around nested units]
        self.shards.prefetch(_neighbour(self.output_order, unit.index, -1))

    def _input_grad_ready(self, unit: Unit, grad: torch.Tensor) -> None:
        # .get: a hook of an earlier forward whose backward never ran may fire after the count was reset
        self.awaiting_inputs[unit.index] = self.awaiting_inputs.get(unit.index, 0) - 1
        if self.state == TrainingState.BACKWARD:
            self._reshard_if_done(unit)

    def bucket_launched(self, bucket: Bucket) -> None:
        """The bucket's gradients are staged and on their way: its unit's parameters may go."""
        self.reduced.add(bucket.index)
        self._reshard_if_done(self.units[self.shards.unit_of_bucket[bucket.index]])

    def _reshard_if_done(self, unit: Unit) -> None:
        """In backward: free a unit once its gradients are launched and, if it has frozen parameters, its
        inputs' gradients are in. The root stays to the end; nothing is freed while pinned."""
        if self.state == TrainingState.PINNED or not unit.index:
            return
        if self.awaiting_inputs.get(unit.index, 0) <= 0 and all(
                b.index in self.reduced for b in self.shards.buckets_of[unit.index]):
            self.shards.reshard(unit)

    def end_of_autograd(self) -> None:
        """The engine's backward is done computing: this rank gathers nothing more in it. Before any wait on a
        gradient reduction, which another rank may still be computing towards (its gathers need this rank)."""
        if self.state != TrainingState.PINNED:
            self.shards.set_phase("backward")
            self.shards.end_phase()

    def finish_backward(self) -> None:
        if self.shards.agreement is not None:
            self.shards.agreement.micro_step += 1
            self.shards.set_phase("between steps")
        self.reduced.clear()
        self.awaiting_inputs.clear()
        if self.state != TrainingState.PINNED:
            self.shards.release_all()
            self.state = TrainingState.IDLE


def _neighbour(order: list[int], unit_index: int, step: int) -> int | None:
    """The unit next to (the last call of) unit_index in a recorded order; None off either end."""
    if unit_index not in order:
        return None
    position = len(order) - 1 - order[::-1].index(unit_index) + step
    return order[position] if 0 <= position < len(order) and order[position] != unit_index else None
