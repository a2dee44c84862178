"""What every stage shares: flat parameters, the fp32 masters of the slices this rank updates (owned by
a masters tier: zerokit/masters/), and the process groups. Subclasses decide only where gradients live
and how a bucket of them is reduced (see stage0.py, stage1.py, stage2.py, stage3.py).

A stage is built in one explicit order by `build` (stage 3 has its own): the layout from the
parameters, then the flat buffer, then the masters over the compute shards, then the stage's own
state in `__init__`. Nothing is created by an overridden method called from a base constructor.

How a bucket is averaged across ranks (pre-division, the collective that leaves this rank its shard, the average
across MiCS replicas) is the stage's `averaging` (stages/averaging.py, with [Note: reducing a bucket to a shard]).

[Note: gradients live from a window's first backward to its step]
A stage's gradient buffer (stages 0-1: the whole flat gradient in the compute dtype; stages 2-3: this rank's
reduced shard of each bucket, in the reduce dtype) is made at the first backward (stages 0-1) or at each bucket's
first reduction (stages 2-3) of an accumulation window and let go of at its step (release_grads), as FSDP2 and
`zero_grad(set_to_none=True)` let torch's gradients go. The forward, where activations reach the step's
high-water mark, then runs without them: an H200 measured the fp32 shard of a 336.9M-parameter model (1.3 GB at
world size 1) held through the forward when it was kept between steps. Made anew, it is zeroed anew: what a
window accumulates starts from zero either way. A bucket's shard made only when the bucket is first reduced keeps
the shards of the units backward has not reached out of the backward's high-water mark, near its start: on an H200,
a 1.1B Llama at stage 3 on one rank peaked 1,992 MiB above FSDP2 while the shards were one buffer made at the first
reduction (benchmarks/gpu_check.py, throughput).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerokit.comm import Communicator, ProcessGroups, Reduction, wait
from zerokit.config.settings import EngineSettings, StageSettings
from zerokit.config.defaults import MAX_BUCKETS_IN_FLIGHT
from zerokit.flat import (Bucket, FlatParameters, ParamEntry, assign_owners, bucket_view, build_layout, gather_bucket,
                          shard_view, tensor_bytes)
from zerokit.masters import OptimizerPlan, ShardMasters
from zerokit.masters.state import load_masters_state, masters_state_dict
from zerokit.masters.shards import TIERS
from zerokit.tiers import DeviceShards, Home, ShardIO, master_homes
from zerokit.tiers.swap import SwapDirectory
from zerokit.stages.averaging import BucketAveraging
from zerokit.stages.usage import GradientUsage
from zerokit.stages.view import FrozenView

class ZeroStage:
    shards_optimizer: ClassVar[bool] = True
    """False only for stage 0, where every rank updates every parameter."""
    reductions_in_flight: int = MAX_BUCKETS_IN_FLIGHT
    """How many bucket reductions the reducer keeps in flight before it waits for the oldest."""

    def __init__(self, flat: FlatParameters, masters: ShardMasters, groups: ProcessGroups, part: StageSettings,
                 settings: EngineSettings) -> None:
        self.flat, self.layout, self.masters = flat, flat.layout, masters
        # part: this room's settings (config/settings.py)
        self.groups, self.comm, self.part, self.settings = groups, groups.shard, part, settings
        self.rank, self.world_size = self.comm.rank, self.comm.world_size  # in the shard group
        self.replica_comm, self.replica_index = groups.replica, groups.replica_index  # See [Note: hybrid sharding]
        self.global_rank = self.replica_index * self.world_size + self.rank
        self.global_world_size = settings.world_size
        self.reduce_dtype = part.reduce_dtype
        self.reduces_every_micro_step = settings.reduces_every_micro_step
        """True where gradients must leave the rank on every micro-step (stage 2's default, stage 3)."""
        self.usage = GradientUsage(len(flat.params))  # See [Note: parameters no rank used]
        self.averaging = BucketAveraging(groups, part, settings, self.bucket_purpose)

    @classmethod
    def build(cls, model: nn.Module, params: list[nn.Parameter], groups: list[int], plan: OptimizerPlan,
              part: StageSettings, settings: EngineSettings, comm: Communicator) -> "ZeroStage":
        """Stages 0-2: every rank holds the whole parameters, in one flat buffer; masters are made from the
        parameters as given (fp32), before the cast to a 16-bit param dtype, so mixed precision starts
        from exactly the user's weights, not from their bf16 rounding. `groups[i]`: params[i]'s flattened
        param group in `plan`."""
        process_groups = ProcessGroups.for_stage(comm, settings)
        global_rank, comm = comm.rank, process_groups.shard  # See [Note: hybrid sharding] in comm/groups.py
        world_size = settings.layout_world_size
        entries = param_entries(model, params, groups, whole_tensor_owners(params, groups, plan, world_size))
        layout = build_layout(entries, world_size, bucket_numel=settings.bucket_numel)
        flat = FlatParameters(params, layout, part.param_dtype)
        full_precision = flat.pack()
        flat.adopt(full_precision)
        rank = comm.rank if cls.shards_optimizer else 0
        owned = [bucket.shard_range(rank) for bucket in layout.buckets]
        homes = master_homes([flat.buffer[begin:end] for begin, end in owned], part.offload, comm.stats, flat.device,
                             global_rank, DeviceShards(flat.device, comm.stats), plan.names)
        masters = ShardMasters(homes, [bucket.param_slices(rank) for bucket in layout.buckets],
                               [groups[b.slots[0].param_index] for b in layout.buckets], plan, part.sub_group_size)
        for index, (begin, end) in enumerate(owned):
            masters.initialise(index, full_precision[begin:end])
        return cls(flat, masters, process_groups, part, settings)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.masters.optimizer

    @property
    def norm_comm(self) -> Communicator | None:
        """The group whose ranks hold different gradient shards (their squares are summed over it), or
        None when every rank holds the same full gradients."""
        return self.comm if self.shards_optimizer else None

    # --- what a subclass provides -------------------------------------------------------------
    def prepare_backward(self) -> None:
        """Called before every backward."""

    def finish_backward(self) -> None:
        """Called after every backward, once its reductions are done: at the boundary with MiCS, the reduced shards
        are averaged across the replicas now (See [Note: hybrid sharding] in comm/groups.py)."""
        self.averaging.average_across_replicas(self.owned_grad, self._accept_grad)

    def on_grad_ready(self, param_index: int) -> None:
        """params[param_index]'s gradient for this backward is complete (autograd hook)."""

    def reduce_bucket(self, bucket: Bucket) -> Reduction:
        raise NotImplementedError

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        """The reduced gradient of the slice of `bucket` this rank updates (param or reduce dtype)."""
        raise NotImplementedError

    def zero_grads(self) -> None:
        raise NotImplementedError

    def gradient_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------------------
    @property
    def reduce_scatter(self) -> bool:
        """Whether buckets are reduce-scattered (else all-reduced, this rank keeping its shard)."""
        return self.averaging.reduce_scatter

    def grad_final(self, bucket: Bucket) -> None:
        """The bucket's reduction at the accumulation boundary is done: its master gets its gradient now (an
        offload tier starts copying it to the host while backward goes on). With MiCS, once it is averaged across
        the replicas too, after backward (See BucketAveraging.average_across_replicas)."""
        if not self.averaging.waits_for_replicas(bucket):
            self._accept_grad(bucket)

    def _accept_grad(self, bucket: Bucket) -> None:
        self.masters.accept_grad(bucket.index, self.owned_grad(bucket))

    def release_grads(self) -> None:
        self.masters.release_grads()
        self.usage.reset()
        self.zero_grads()

    def drop_window(self) -> None:
        """Drop the gradients of an accumulation window that will not be stepped: those accumulated locally (full
        gradients, staged buckets) as well as the reduced ones."""
        for param in self.flat.params:
            param.grad = None
        self.release_grads()

    def install_module_hooks(self, release_reductions: Callable[[], None]) -> list[RemovableHandle]:
        """Hooks of the stage's own on the model's modules (stage 3: its units'); none below stage 3.
        `release_reductions` launches every gradient reduction not launched yet (the reducer's)."""
        return []

    def end_of_autograd(self) -> None:
        """Backward is done computing, before any wait on a gradient reduction (stage 3 tells the other ranks
        it gathers nothing more); nothing to do below stage 3."""

    def recomputed_modules(self) -> list[nn.Module]:
        """Modules whose forward the engine checkpoints: none below stage 3 (a model checkpoints its own)."""
        return []

    def publish_params(self) -> None:
        """After the optimizer step: masters -> compute-dtype params, then all-gather the shards."""
        self.masters.publish()
        if self.shards_optimizer:
            buffer = self.flat.buffer
            pending = [gather_bucket(self.comm, b, bucket_view(buffer, b), shard_view(buffer, b, self.rank), True,
                                     purpose=f"updated parameters: bucket {b.index}")
                       for b in self.layout.buckets]
            for item in pending:
                wait(item)

    def after_load(self) -> None:
        """A checkpoint wrote into the masters (and frozen parts): make them the model's parameters again."""
        self.publish_params()

    def frozen_parts(self) -> tuple[set[int], list[FrozenView]]:
        """The ids of the frozen parameters the stage shards, and this rank's parts of them: none below stage 3."""
        return set(), []

    def write_back_params(self) -> None:
        """The user changed parameters in place: make the fp32 masters agree."""
        self.masters.write_back()

    @contextmanager
    def gathered(self, units: Any = None, write_back: bool = False) -> Iterator[None]:
        """Stages 0-2 always hold full parameters; only edits need handing back to the masters."""
        try:
            yield
        finally:
            if write_back:
                self.write_back_params()

    def units_of(self, params: list[nn.Parameter]) -> None:
        return None

    def saving_plan(self, model: nn.Module) -> list[tuple[Any, list[nn.Parameter]]]:
        """What to gather together when saving: (units, their parameters); here all at once."""
        return [(None, list(model.parameters()))]

    def frozen_bytes(self, model: nn.Module) -> dict[str, int]:
        """Bytes this rank holds for the frozen parameters (requires_grad=False) of `model`, by tier: stages
        0-2 keep them whole, in the compute dtype, on the device."""
        trainable = {id(p) for p in self.flat.params}
        return {"device": tensor_bytes(p for p in model.parameters() if id(p) not in trainable)}

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of trainable parameters by tier: the flat buffer, on the device."""
        return {"device": tensor_bytes([self.flat.buffer])}

    # --- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release what would otherwise last until interpreter exit: the NVMe tiers' swap files, then the process
        groups (See Engine.close)."""
        for directory in self.swap_directories():
            directory.close()
        self.groups.close()

    def swap_directories(self) -> list[SwapDirectory]:
        """The swap folders of this stage's NVMe tiers (none without offload to nvme)."""
        return swap_directories_of(self.masters.homes)

    def bucket_purpose(self, bucket: Bucket) -> str:
        """What a bucket's reduction is for, as failure reports name it (See [Note: the flight recorder])."""
        return f"gradients: bucket {bucket.index} of param group {bucket.group}"

    def describe(self) -> list[str]:
        """One line each for the start-up log."""
        return [layout_line(self), *hybrid_lines(self)]

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The masters and the optimizer; stages 0-2 derive the compute parameters from the masters."""
        return {"masters": masters_state_dict(self.masters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_masters_state(self.masters, state["masters"])
        self.publish_params()


def param_entries(model: nn.Module, params: list[nn.Parameter], keys: list[int],
                  owners: list[int | None]) -> list[ParamEntry]:
    """The layout's view of `params`: size, bucket key, state-dict name (a tied one's first), shape, owner."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [ParamEntry(p.numel(), key, names.get(id(p), ""), tuple(p.shape), owner)
            for p, key, owner in zip(params, keys, owners)]


def whole_tensor_owners(params: list[nn.Parameter], groups: list[int], plan: OptimizerPlan,
                        world_size: int) -> list[int | None]:
    """The rank that owns each parameter of a whole-tensor optimizer (See [Note: buckets owned by one rank]
    in flat/layout.py); None for the others, and for all when nothing is sharded."""
    whole = [i for i, g in enumerate(groups) if plan.refs[g].whole_tensor] if world_size > 1 else []
    owners: list[int | None] = [None] * len(params)
    for index, owner in zip(whole, assign_owners([params[i].numel() for i in whole], world_size)):
        owners[index] = owner
    return owners


def swap_directories_of(holders: list[Home | ShardIO]) -> list[SwapDirectory]:
    """The distinct swap folders among `holders` (master homes, a shard home): the NVMe tiers'."""
    found = {id(holder.swap): holder.swap for holder in holders if holder.swap is not None}
    return list(found.values())


def memory_by_tier(stage: ZeroStage, model: nn.Module, experts: ZeroStage | None = None) -> dict[str, dict[str, int]]:
    """Bytes this rank holds by tier (device, host, nvme) and category (parameters, trainable and frozen;
    gradients; optimizer_state: fp32 masters, when separate, and the optimizer's own state). `experts`: the stage of
    the model's MoE experts split over ranks, beside `stage` (See [Note: ZeRO over experts split across ranks] in
    zerokit/parallel/experts/share.py)."""
    held = {tier: {"parameters": 0, "gradients": 0, "optimizer_state": 0} for tier in TIERS}
    for each in [stage] if experts is None else [stage, experts]:
        held["device"]["gradients"] += tensor_bytes(each.gradient_tensors())
        for tier, count in each.parameter_bytes().items():
            held[tier]["parameters"] += count
        for tier, categories in each.masters.held_by_tier().items():
            for category, count in categories.items():
                held[tier][category] += count
    for tier, count in stage.frozen_bytes(model).items():
        held[tier]["parameters"] += count
    if experts is not None:  # `stage` counts split experts among the parameters it does not train: theirs holds them
        held["device"]["parameters"] -= tensor_bytes(experts.flat.params)
    return held


@contextmanager
def gathered(stage: ZeroStage, units: Any, write_back: bool, experts: ZeroStage | None = None) -> Iterator[None]:
    """`stage.gathered(units, write_back)`, and with `experts` (the stage of split MoE experts: at most stage 2, which
    holds full parameters) their edits handed back to their masters too."""
    with stage.gathered(units, write_back=write_back):
        if experts is None:
            yield
        else:
            with experts.gathered(None, write_back=write_back):
                yield


def layout_line(stage: ZeroStage) -> str:
    """The start-up line saying the stage, the ranks, the buckets and how each is reduced."""
    layout = stage.layout
    reduction = "all-reduced" if not stage.shards_optimizer else (
        "reduce-scattered" if stage.reduce_scatter else "all-reduced, this rank keeping its shard")
    return (f"ZeRO stage {stage.part.stage} ({type(stage).__name__}) on {stage.world_size} rank(s), "
            f"{stage.comm.backend}: {layout.data_numel:,} trainable parameters in {len(layout.buckets)} "
            f"bucket(s) of up to {max((b.numel for b in layout.buckets), default=0):,} elements, each {reduction}")


def hybrid_lines(stage: ZeroStage) -> list[str]:
    """With MiCS: the groups, and whether they line up with the nodes (a knob of speed: said, not refused)."""
    if stage.replica_comm is None:
        return []
    s, per_node = stage.world_size, stage.settings.ranks_per_node
    aligned = "" if per_node % s == 0 or s % per_node == 0 else (
        f"; shard groups straddle nodes of {per_node} ranks, so their gathers cross nodes too")
    return [f"MiCS: shard groups of {s} consecutive ranks, {stage.settings.replicas} replicas, gradients averaged "
            f"across replicas once per optimizer step{aligned}"]
