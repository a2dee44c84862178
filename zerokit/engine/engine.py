"""The engine a user trains with: forward, backward, step, and what it holds and sends.

One optimizer step, in order (See [Note: buckets are the unit of sharding]):
  forward -> backward, gradients land in buckets -> each bucket is all-reduced (stage 0) or
  reduce-scattered (stages 1-2) as soon as it is complete, overlapped with the rest of backward ->
  at the accumulation boundary (step.py): unscale, one scalar all-reduce for the global norm and overflow,
  clip -> optimizer step on the fp32 master shard -> cast and all-gather the updated shards.
What the engine will do is decided once (config/settings.py); checkpoints and full_state_dict() see the stage through
its per-parameter view (stages/view.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerokit.checkpoint.data_position import DataPosition
from zerokit.checkpoint.newest import resume_from_newest
from zerokit.checkpoint.session import close as close_checkpoints
from zerokit.comm import Communicator
from zerokit.config.resolve import parts_before_facts, resolve
from zerokit.config.typed import ZeroConfig, hidden_size_of, load_config
from zerokit.engine.state import totals
from zerokit.engine.checkpoints import Checkpoints
from zerokit.checkpoint.locate import layout_directory
from zerokit.engine.backward import ExternalBackward, micro_step
from zerokit.engine.build import grad_accum_dtype_lines, learning_rates, lr_schedules_for, optimizers_for
from zerokit.parallel.mesh import Layout, checked_layout
from zerokit.masters import OptimizerPlan, optimizer_kind, share_optimizers, trainable_groups
from zerokit.engine.activations import ActivationCheckpointer
from zerokit.observe import EngineMonitor, collective_stats
from zerokit.precision.result import StepResult
from zerokit.precision.scaler import make_loss_scaler
from zerokit.reliability.preemption import PreemptionWatcher
from zerokit.reliability import Safeguards, check_at_start
from zerokit.comm.process import close_at_exit, default_device, ensure_process_group, forget_at_exit
from zerokit.config.settings import Facts, RunSettings, launcher_node_rank, launcher_ranks_per_node
from zerokit.stages import STAGES, BucketReducer, ZeroStage, install_hooks
from zerokit.stages.base import gathered, memory_by_tier
from zerokit.engine.step import Progress, Stepper
from zerokit.engine.startup import log_startup
from zerokit.parallel.experts.hf import split_hf_experts
from zerokit.parallel.experts.share import ExpertShare, expert_layout, expert_share, refuse_with_experts
from zerokit.parallel.experts.share import startup_lines as expert_startup_lines
from zerokit.parallel.sequence.share import sequence_layout, sequence_share
from zerokit.parallel.sequence.share import startup_lines as sequence_startup_lines
from zerokit.parallel.tensor.setup import batch_ranks, parallelize, tensor_layout
from zerokit.parallel.tensor.setup import startup_lines as tensor_startup_lines
from zerokit.stages.construction import ParamInit, has_meta_parameters, place_model
from zerokit.stages.view import ParameterView


Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


class Engine(ExternalBackward, Checkpoints):
    def __init__(self, model: nn.Module, optimizer: Optimizers | None, config: ZeroConfig,
                 device: torch.device | None = None, param_init: ParamInit | None = None,
                 model_parameters: Iterable[Any] | None = None, layout: Layout | None = None) -> None:
        """Built in the order the config is walked: the mesh (the tensor degree), the engine's group, the run's
        settings resolved once against its facts (See [Note: each room gets its part] in zerokit/config/settings.py),
        then each room with its part, in the order a step's data flows (See _build).
        `optimizer`: one torch optimizer, or a list of them, each over its own parameters (Muon for the
        hidden matrices beside AdamW for the rest, say); None: the config's `optimizer` block's, built over
        `model_parameters` (default: the model's trainable parameters). `layout`: the job's pipeline x data x tensor
        mesh (See [Note: one layout, resolved once] in zerokit/parallel/mesh.py); the engine shards over this rank's
        data group. None: over every rank."""
        ensure_process_group()
        launcher_per_node, node_rank = launcher_ranks_per_node(), launcher_node_rank()  # torchrun's, read once
        # The mesh first: the tensor degree decides this rank's data group, whose size the facts below are
        # (See zerokit/parallel/tensor/setup.py: the tensor degree, the model split by its plan, the tensor group)
        tensor_part, comm_part = parts_before_facts(config, launcher_per_node)
        # the expert degree of the model's MoE layers last: it splits the data dimension the others leave
        self.layout = checked_layout(expert_layout(sequence_layout(tensor_layout(layout, tensor_part), tensor_part),
                                                   model, tensor_part))
        # a Hugging Face model's experts split over the layout's expert groups, where the config asks (See hf.py)
        optimizer, model_parameters = split_hf_experts(model, self.layout, tensor_part, optimizer, model_parameters)
        hidden_size = hidden_size_of(model)  # a fact for "auto" sizes, from the model's Hugging Face config
        self.tensor, optimizer, model_parameters = parallelize(model, self.layout, tensor_part, optimizer,
                                                               model_parameters)
        # the sequence groups, and the model's attention split over them (See zerokit/parallel/sequence)
        self.sequence = sequence_share(self.layout, model)
        mesh_lines = tensor_startup_lines(self.layout, tensor_part, self.tensor) + sequence_startup_lines(self.layout)
        counted_ranks = batch_ranks(self.layout, tensor_part)  # a fact: the ranks the batch sizes count
        # the engine's group (its waits have the config's deadline) before resolve: its size and back-end are facts
        self.comm = Communicator.create(comm_part.timeout_seconds, stats=collective_stats(comm_part.logger),
                                        parts=None if self.layout is None else self.layout.data_groups())
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        # MoE experts split over ranks: their layers' expert groups, and the expert-data group their states shard over
        self.experts = expert_share(self.layout, model, self.comm)
        facts = Facts(world_size=self.world_size, backend=self.comm.backend, hidden_size=hidden_size,
                      ranks_per_node=launcher_per_node, node_rank=node_rank,
                      batch_ranks=counted_ranks)
        # See [Note: each room gets its part] in zerokit/config/settings.py; engine.config keeps the whole, for the
        # public API
        self.config, self.parts = resolve(config, facts)
        # See [Note: one place for each engine decision] in zerokit/config/settings.py
        self.settings = self.parts.decisions
        self.device, self.module = device or default_device(), model
        self._build(optimizer, model_parameters, param_init, mesh_lines)
        self.closed = False
        close_at_exit(self)  # See [Note: leaving at exit] in comm/process.py

    def _build(self, optimizer: Optimizers | None, model_parameters: Iterable[Any] | None,
               param_init: ParamInit | None, mesh_lines: list[str]) -> None:
        """Each room built with its part of the settings, in the order a step's data flows: the stage (layout, flat
        buffers, masters), the reducer and the hooks that fill its buckets, the guards, the step, then what watches
        the step (monitor, activations, preemption)."""
        config, parts, model = self.config, self.parts, self.module
        self.stage, self.expert_stage, kinds = _build_stage(model, optimizer, model_parameters, param_init, config,
                                                            parts, self.comm, self.device, self.experts)
        self.optimizer = self.stage.optimizer if self.stage.masters.optimizers else None  # None: forward only
        self.view = ParameterView(self.stage, model, kinds)  # See [Note: a per-parameter view of the stage]
        self.lr_schedules = lr_schedules_for(config, self.stage.masters.optimizers)  # See zerokit/engine/build.py
        # the reducer before the hooks: a gradient's hook hands its bucket to the reducer; the split experts' stage
        # has its own (See [Note: ZeRO over experts split across ranks] in parallel/experts/share.py)
        self.reducer, self._hooks = _reducer_and_hooks(self.stage)
        self.expert_reducer, expert_hooks = _reducer_and_hooks(self.expert_stage)
        self._hooks += expert_hooks
        self.safeguards = Safeguards(model, self.comm, parts.safeguards, forward_only=self.optimizer is None)
        self.loss_scaler, self.progress = make_loss_scaler(parts.step.loss_scaling), Progress()
        self.data_position = DataPosition(self.rank)  # the loader whose position checkpoints save (.track(loader))
        self.stages_comm = _pipeline_comm(self.layout, parts.comm.timeout_seconds)  # the norm across the stages
        # the stepper after the stage, scaler, schedules and guards it drives
        self.stepper = Stepper(self.stage, self.loss_scaler, self.lr_schedules, self.safeguards, parts.step,
                               self.tensor, other_stages=self.stages_comm, experts=self.expert_stage)
        self.monitor = EngineMonitor(parts.observe, self)  # the observability keys; all off unless the config asks
        # See [Note: each engine checkpoints with its own settings] in zerokit/engine/activations.py; after the stage,
        # whose units it recomputes
        self.activations = ActivationCheckpointer(parts.activations, self.comm.stats, self.device)
        self.activations.checkpoint_modules(self.stage.recomputed_modules())
        experts = expert_startup_lines(self.experts, self.trainable_numel() - self.stage.layout.data_numel)
        setup_lines = grad_accum_dtype_lines(config) + mesh_lines + experts + self.activations.startup_lines()
        log_startup(self.stage, list(parts.startup_lines) + setup_lines, parts.warnings)
        # last: a signal saves a checkpoint, which needs everything above
        self.preemption = PreemptionWatcher(parts.preemption, self.comm, self.save_checkpoint)

    # --- the training loop ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_if_closed("forward")
        with self.monitor.forward(), self.activations.running():  # forward time and FLOPs (zerokit/observe)
            return self.module(*args, **kwargs)

    @property
    def at_boundary(self) -> bool:
        """The next backward ends an accumulation window."""
        return (self.progress.micro_step + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, average_window: bool = True) -> None:
        """Backward of `loss / gradient_accumulation_steps` (times the fp16 loss scale), with the
        gradient reductions this micro-step needs overlapped with it. average_window=False: of `loss` as it is
        (a caller that divided it already, as Hugging Face's Trainer does)."""
        self._refuse_if_closed("backward")
        scaled = loss * (self.loss_scaler.scale / (self.config.gradient_accumulation_steps if average_window else 1))
        with micro_step(self, [scaled], observed=loss):
            scaled.backward()

    def step(self) -> StepResult:
        """Step the optimizer if this micro-step ended an accumulation window; report either way."""
        self._refuse_if_closed("step")
        with self.monitor.step() as (done, lap):  # observability (zerokit/observe): step times, logs, monitors
            result = done(self.stepper.step(self.progress, lap))
        self.preemption.after_step(result)  # a signal any rank got: save and exit (See [Note: preemption])
        return result

    def get_lr(self) -> list[float]:
        """The learning rate of every param group, optimizer by optimizer, as the next step will use it."""
        return learning_rates(self.stage.masters.optimizers)

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | list[torch.optim.lr_scheduler.LRScheduler] | None:
        """The `scheduler` block's schedule (a list, one per optimizer, when there are several), stepped by
        the engine; None without a block."""
        if not self.lr_schedules:
            return None
        return self.lr_schedules[0] if len(self.lr_schedules) == 1 else self.lr_schedules

    # --- what it holds and sends -----------------------------------------------------------------
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Per collective kind: calls, elements and bytes of the logical tensors, since start."""
        return self.comm.stats.as_dict()

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds, by category: parameters (trainable and frozen), gradients,
        optimizer_state (fp32 masters, when separate, and the optimizer's own state); on every tier
        together (See memory_by_tier)."""
        return totals(self.memory_by_tier())

    def memory_by_tier(self) -> dict[str, dict[str, int]]:
        """memory_stats() by tier: what this rank holds on the device, in host memory (offload tiers) and in
        NVMe files."""
        return memory_by_tier(self.stage, self.module, self.expert_stage)

    def unsharded(self, params: list[nn.Parameter] | None = None, write_back: bool = False):
        """Context: the given parameters (default: all) hold their full values until exit, as
        DeepSpeed's GatheredParameters does. At stage 3 this costs their full size in memory for the
        duration (generation inside it gathers nothing per token); stages 0-2 hold them anyway.
        write_back=True: in-place edits made inside (identically on every rank) are kept, masters included."""
        units = self.stage.units_of(list(params)) if params is not None else None
        return gathered(self.stage, units, write_back, self.expert_stage)

    def plan_report(self, **options: Any) -> list[dict]:
        """The planner's prediction for this run beside what the run measured, row by row (category, predicted,
        measured, error); record the run first with zerokit.profiling.record_run(engine, ...). `options`:
        those of zerokit.profiling.report.plan_report (record, calibration, device, mfu)."""
        from zerokit.profiling.report import plan_report
        return plan_report(self, **options)

    def trainable_numel(self) -> int:
        """Ψ: trainable parameters, without padding."""
        return sum(stage.layout.data_numel for stage, _ in self.rooms())

    # --- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the engine holds outside itself, now: its hooks on the model, its monitors' files, the
        checkpoint session (an asynchronous save still writing is waited for), the NVMe tiers' swap files, and
        the process groups it made (destroyed, their gloo threads joined). Idempotent; the engine refuses to
        train after it. A script need not call it: engines still open at interpreter exit are closed then, before
        the default group goes (See [Note: leaving at exit] in comm/process.py)."""
        if self.closed:
            return
        self.closed = True
        forget_at_exit(self)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.safeguards.close()
        self.monitor.close()
        self.preemption.close()
        try:
            close_checkpoints(self.checkpointed(made=False))  # the split experts' view, where one was made
        finally:
            self.stage.close()
            if self.expert_stage is not None:
                self.expert_stage.close()
            for group in (self.tensor, self.stages_comm):  # a tensor-parallel model's; the pipeline's
                if group is not None:
                    group.close()

    def _refuse_if_closed(self, call: str) -> None:
        if self.closed:
            raise RuntimeError(f"engine.{call}() after engine.close() (or destroy()): a closed engine has no hooks or "
                               "process groups; build a new one with zerokit.initialize to train again")

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)


def _build_stage(model: nn.Module, optimizer: Optimizers | None, model_parameters: Iterable[Any] | None,
                 param_init: ParamInit | None, config: ZeroConfig, parts: RunSettings, comm: Communicator,
                 device: torch.device, experts: ExpertShare | None
                 ) -> tuple[ZeroStage, ZeroStage | None, list[str]]:
    """The model and its optimizers made into the config's stage (layout, flat buffers, masters; See ZeroStage.build),
    the model placed on `device` and cast to the compute dtype; with each optimizer's kind. With `experts` (MoE
    experts split over ranks), their parameters make a second stage over their expert-data group, stepped by the same
    optimizers (See [Note: ZeRO over experts split across ranks] in zerokit/parallel/experts/share.py); else None."""
    optimizers = optimizers_for(model, optimizer, config, model_parameters)
    kinds = [optimizer_kind(o, config.optimizer_kinds, config.allow_untested_optimizer) for o in optimizers]
    check_at_start(model, optimizers, parts.safeguards, comm, device)  # before any collective on the model
    if experts is not None:
        nvme = "nvme" in (config.offload_optimizer.device, config.offload_param.device)
        refuse_with_experts(parts.decisions.replicas > 1, nvme, has_meta_parameters(model))
    construction = place_model(model, optimizers, param_init, config.stage, device, comm,
                               None if experts is None else (experts.params, experts.data))
    # no optimizer: nothing trains, every parameter is held as a frozen one (See zerokit/reliability/forward_only.py)
    groups, refs = trainable_groups(model, optimizers, kinds) if optimizers else ([], [])
    params, group_of_param = _backward_ordered(model, groups)
    plan = OptimizerPlan(tuple(optimizers), tuple(refs))
    extra = {"construction": construction} if construction is not None else {}
    split = experts.params if experts is not None else frozenset()
    if split and config.stage == 3:  # See [Note: split experts in a ZeRO-3 job] in zerokit/parallel/experts/share.py
        extra["held_elsewhere"] = split
    dense = [(p, g) for p, g in zip(params, group_of_param) if id(p) not in split]
    stage = STAGES[config.stage].build(model, [p for p, _ in dense], [g for _, g in dense], plan, parts.stage,
                                       parts.decisions, comm, **extra)
    expert_stage = None
    if experts is not None:
        expert = [(p, g) for p, g in zip(params, group_of_param) if id(p) in split]
        expert_stage = _expert_stage(model, expert, plan, config.stage, parts, experts)
        share_optimizers(stage.masters, expert_stage.masters, plan)
    # Frozen parameters (stages 0-2; stage 3 shards them in the compute dtype already) and buffers; trainable ones
    # are cast.
    model.to(dtype=config.precision.param_dtype)
    return stage, expert_stage, kinds


def _expert_stage(model: nn.Module, expert: list[tuple[nn.Parameter, int]], plan: OptimizerPlan, stage: int,
                  parts: RunSettings, experts: ExpertShare) -> ZeroStage:
    """The split experts' stage over their expert-data group: `expert`, their trainable parameters with each one's
    param group (See [Note: ZeRO over experts split across ranks] in zerokit/parallel/experts/share.py)."""
    others = frozenset(id(p) for p in model.parameters()) - experts.params  # the dense stage's, trainable or frozen
    extra = {"held_elsewhere": others} if stage == 3 else {}
    return STAGES[stage].build(model, [p for p, _ in expert], [g for _, g in expert], plan, experts.part(parts.stage),
                               experts.settings(parts.decisions), experts.data, **extra)


def _reducer_and_hooks(stage: ZeroStage | None) -> tuple[BucketReducer | None, list[RemovableHandle]]:
    """The reducer of `stage`'s gradient buckets, and the hooks that hand it each gradient (none without a stage)."""
    if stage is None:
        return None, []
    reducer = BucketReducer(stage)
    return reducer, install_hooks(stage, reducer)


def _pipeline_comm(layout: Layout | None, timeout_seconds: float) -> Communicator | None:
    """A group over this rank's pipeline (its stage's ranks in the other stages), or None without a pipeline.
    Every rank makes every pipeline's group, at the same point of building its engine."""
    if layout is None or layout.pipeline == 1:
        return None
    return Communicator.create(timeout_seconds, parts=layout.pipeline_groups())


def _backward_ordered(model: nn.Module, groups: list[list[nn.Parameter]]) -> tuple[list[nn.Parameter], list[int]]:
    """Trainable parameters in the order backward usually produces their gradients (reverse
    registration), with each one's optimizer param group."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    entries = sorted(((p, g) for g, params in enumerate(groups) for p in params), key=lambda e: -position[id(e[0])])
    return [p for p, _ in entries], [g for _, g in entries]


def initialize(model: nn.Module, optimizer: Optimizers | None = None,
               config: ZeroConfig | Mapping[str, Any] | str | Path | None = None,
               device: torch.device | None = None, param_init: ParamInit | None = None,
               model_parameters: Iterable[Any] | None = None, layout: Layout | None = None) -> Engine:
    """Wrap `model` and `optimizer` (one, or a list each over its own parameters; `engine.optimizer` is
    then the list, rebuilt in the same order) for ZeRO training. `config` is a ZeroConfig, a DeepSpeed-style
    dict, or the path of a JSON file holding one. Joins torchrun's process group if there is one.
    With no optimizer, the config's `optimizer` block names one, built over `model_parameters` (param groups,
    tensors or (name, tensor) pairs; default: the model's trainable parameters); its `scheduler` block's LR
    schedule is stepped by the engine at every optimizer step it does not skip (engine.get_lr() reports it).
    A model built on the meta device is materialised shard by shard at stage 3, with `param_init(module)`
    filling each module's parameters (default: its reset_parameters()); see zerokit/stages/construction.py.
    With the config's `resume` block the engine comes back at the newest complete checkpoint in resume.load_dir, if
    there is one (See zerokit/checkpoint/newest.py); a loader tracked then (engine.data_position.track) resumes too.
    `layout`: a zerokit.Layout of pipeline x data x tensor degrees; the engine shards over this rank's data group.
    Tensor parallelism (docs/tensor_parallel.md): the config's tensor_parallel.autotp_size splits the model by its
    Hugging Face plan; or pass a model parallelized with torch's parallelize_module on
    layout.device_mesh(...)["tensor"]."""
    engine = Engine(model, optimizer, load_config(config), device, param_init, model_parameters, layout)
    if engine.config.resume.load_dir is not None:
        resume_from_newest(engine, layout_directory(engine.config.resume.load_dir, engine.layout))
    return engine
