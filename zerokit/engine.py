"""The engine a user trains with: forward, backward, step, and what it holds and sends.

One optimizer step, in order (See [Note: buckets are the unit of sharding]):
  forward -> backward, gradients land in buckets -> each bucket is all-reduced (stage 0) or
  reduce-scattered (stages 1-2) as soon as it is complete, overlapped with the rest of backward ->
  at the accumulation boundary: unscale, one scalar all-reduce for the global norm and overflow,
  clip -> optimizer step on the fp32 master shard -> cast and all-gather the updated shards.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import torch
from torch import nn

from zerokit.comm import Communicator
from zerokit.config import ZeroConfig, hidden_size_of, load_config
from zerokit.masters import OptimizerPlan, optimizer_kind, trainable_groups
from zerokit.precision import StepResult, clip_coefficient, global_norm, make_loss_scaler
from zerokit.runtime import default_device, ensure_process_group, log_startup
from zerokit.stages import STAGES, BucketReducer, install_hooks
from zerokit.stages.construction import (Construction, ParamInit, has_meta_parameters, init_buffer_owners,
                                        replace_meta_parameters, reset_parameters)


Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


class SkippedStepsError(RuntimeError):
    """Too many optimizer steps in a row were skipped for inf/nan gradients."""


@dataclass
class Progress:
    """Where training stands: what a resumed run must restore besides the model states."""

    micro_step: int = 0
    optimizer_step: int = 0
    consecutive_skips: int = 0
    total_skips: int = 0
    backward_since_step: bool = False  # a second step() after one backward() would step on stale gradients


class Engine:
    def __init__(self, model: nn.Module, optimizer: Optimizers, config: ZeroConfig,
                 device: torch.device | None = None, param_init: ParamInit | None = None) -> None:
        """Built in the order a step's data flows: the process group, the model on its device, the stage
        (layout, flat buffers, masters; See ZeroStage.build), the reducer, then the hooks that drive them.
        `optimizer`: one torch optimizer, or a list of them, each over its own parameters (Muon for the
        hidden matrices beside AdamW for the rest, say)."""
        ensure_process_group()
        self.comm = Communicator()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        config = self.config = config.resolve(world_size=self.world_size, hidden_size=hidden_size_of(model))
        refuse_unimplemented(config)
        self.device = device or default_device()
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        kinds = [optimizer_kind(o, config.optimizer_kinds, config.allow_untested_optimizer) for o in optimizers]
        construction = self._place_model(model, optimizers, param_init)
        self.module = model
        groups, refs = trainable_groups(model, optimizers, kinds)
        params, group_of_param = _backward_ordered(model, groups)
        plan = OptimizerPlan(tuple(optimizers), tuple(refs))
        extra = {"construction": construction} if construction is not None else {}
        self.stage = STAGES[config.stage].build(model, params, group_of_param, plan, config, self.comm, **extra)
        # Frozen parameters (stages 0-2; stage 3 shards them in the compute dtype already) and buffers;
        # trainable ones are cast.
        model.to(dtype=config.precision.param_dtype)
        self.optimizer = self.stage.optimizer
        self.reducer = BucketReducer(self.stage)
        self._hooks = install_hooks(self.stage, self.reducer)
        self.loss_scaler = make_loss_scaler(config.loss_scaling)
        self.progress = Progress()
        log_startup(self.stage, config.startup_log_lines())

    def _place_model(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                     param_init: ParamInit | None) -> Construction | None:
        """Move the model to this rank's device. A model built on the meta device is left for stage 3 to
        materialise unit by unit (See [Note: sharded construction]); any other starts from rank 0's
        weights and buffers, as torch DDP does."""
        if has_meta_parameters(model):
            if self.config.stage != 3:
                raise ValueError(f"a model on the meta device needs zero_optimization.stage=3 (got "
                                 f"{self.config.stage}): only stage 3 never holds the whole model")
            pending, buffer_owners = replace_meta_parameters(model, optimizers, self.device)
            init_buffer_owners(buffer_owners, param_init or reset_parameters)
            model.to(device=self.device)
            return Construction(pending, param_init or reset_parameters, verify=True)
        if param_init is not None:
            raise ValueError("param_init is for models built on the meta device; this model has real parameters")
        model.to(device=self.device)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                self.comm.broadcast(tensor.data, src=0)
        return None

    # --- the training loop ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def at_boundary(self) -> bool:
        """The next backward ends an accumulation window."""
        return (self.progress.micro_step + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss / gradient_accumulation_steps` (times the fp16 loss scale), with the
        gradient reductions this micro-step needs overlapped with it."""
        must_reduce = self.at_boundary or self.stage.reduces_every_micro_step
        self.stage.prepare_backward()
        scaled = loss * (self.loss_scaler.scale / self.config.gradient_accumulation_steps)
        if must_reduce:
            self.reducer.arm(scaled, final=self.at_boundary)
        scaled.backward()
        self.reducer.flush()
        self.stage.finish_backward()
        self.progress.micro_step += 1
        self.progress.backward_since_step = True

    def step(self) -> StepResult:
        """Step the optimizer if this micro-step ended an accumulation window; report either way."""
        progress = self.progress
        if not progress.backward_since_step:
            raise RuntimeError("engine.step() was called without an engine.backward() since the last step; "
                               "call engine.backward(loss) once before each engine.step()")
        progress.backward_since_step = False
        if progress.micro_step % self.config.gradient_accumulation_steps != 0:
            return self._result(boundary=False, stepped=False, norm=None, clipped=False)
        stage, masters = self.stage, self.stage.masters
        norm = self._norm_and_usage(masters.unscaled_square_sum(self.loss_scaler.scale))
        overflow = norm != norm  # nan: some gradient was inf or nan on some rank
        self.loss_scaler.update(overflow)
        if overflow:
            stage.release_grads()
            return self._skip()
        masters.drop_unused(stage.usage.agreed)
        coefficient = clip_coefficient(norm, self.config.gradient_clipping)
        masters.step(coefficient)
        self.stage.release_grads()
        self.stage.publish_params()
        progress.optimizer_step += 1
        progress.consecutive_skips = 0
        return self._result(boundary=True, stepped=True, norm=norm, clipped=coefficient < 1.0)

    def _norm_and_usage(self, squares: float) -> float:
        """The global gradient norm from this rank's sum of squares; at stages 1-3 the same all-reduce sums
        which parameters each rank used (stage 0's last bucket carried them: See [Note: parameters no rank
        used])."""
        comm, usage = self.stage.norm_comm, self.stage.usage
        if comm is None:
            return global_norm(squares, None)
        flags = usage.flags(torch.float64, comm.device)
        norm = global_norm(squares, comm, flags)
        usage.agree(flags)
        return norm

    def _skip(self) -> StepResult:
        progress = self.progress
        progress.consecutive_skips += 1
        progress.total_skips += 1
        if progress.consecutive_skips >= self.config.max_consecutive_skipped_steps:
            raise SkippedStepsError(
                f"{progress.consecutive_skips} optimizer steps in a row were skipped for inf/nan gradients "
                f"(loss scale now {self.loss_scaler.scale:g}); the model is not training. Lower the learning "
                "rate, check the data, or raise max_consecutive_skipped_steps")
        return self._result(boundary=True, stepped=False, norm=float("nan"), clipped=False)

    def _result(self, boundary: bool, stepped: bool, norm: float | None, clipped: bool) -> StepResult:
        progress = self.progress
        return StepResult(micro_step=progress.micro_step, optimizer_step=progress.optimizer_step, boundary=boundary,
                          stepped=stepped, skipped=boundary and not stepped, loss_scale=self.loss_scaler.scale,
                          grad_norm=norm, clipped=clipped, consecutive_skips=progress.consecutive_skips,
                          total_skips=progress.total_skips)

    # --- what it holds and sends -----------------------------------------------------------------
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Per collective kind: calls, elements and bytes of the logical tensors, since start."""
        return self.comm.stats.as_dict()

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds, by category: parameters (trainable and frozen), gradients,
        optimizer_state (fp32 masters, when separate, and the optimizer's own state)."""
        stats = self.stage.memory_by_category()
        stats["parameters"] += self.stage.frozen_bytes(self.module)  # whole at stages 0-2, sharded at stage 3
        return stats

    def unsharded(self, params: list[nn.Parameter] | None = None, write_back: bool = False):
        """Context: the given parameters (default: all) hold their full values until exit, as
        DeepSpeed's GatheredParameters does. At stage 3 this costs their full size in memory for the
        duration (generation inside it gathers nothing per token); stages 0-2 hold them anyway.
        write_back=True: in-place edits made inside (identically on every rank) are kept, masters included."""
        units = self.stage.units_of(list(params)) if params is not None else None
        return self.stage.gathered(units, write_back=write_back)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU in fp32 (parameters at their compute precision), gathered
        one unit at a time at stage 3 so the extra peak is the largest unit, not the model."""
        names = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        state: dict[str, torch.Tensor] = {}
        for units, params in self.stage.saving_plan(self.module):
            with self.stage.gathered(units):
                for param in params:
                    for name in names[id(param)]:
                        state[name] = param.detach().float().cpu().clone()
        saved = self.module.state_dict(keep_vars=True)  # which buffers are persistent, and the key order
        for name, buffer in self.module.named_buffers():
            if name in saved:
                state[name] = buffer.detach().cpu().clone()
        return {name: state[name] for name in saved}

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank holds that a resumed run needs: its shard of the model states (masters,
        optimizer, and at stage 3 the frozen shards), the loss scaler and the step counters."""
        return {"stage": self.stage.state_dict(), "loss_scaler": self.loss_scaler.state_dict(),
                "progress": asdict(self.progress)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The inverse of state_dict(), on the same world size, stage and layout."""
        self.stage.load_state_dict(state["stage"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.progress = Progress(**state["progress"])

    def trainable_numel(self) -> int:
        """Ψ: trainable parameters, without padding."""
        return self.stage.layout.data_numel

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)


def _backward_ordered(model: nn.Module, groups: list[list[nn.Parameter]]) -> tuple[list[nn.Parameter], list[int]]:
    """Trainable parameters in the order backward usually produces their gradients (reverse
    registration), with each one's optimizer param group."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    entries = sorted(((p, g) for g, params in enumerate(groups) for p in params), key=lambda e: -position[id(e[0])])
    return [p for p, _ in entries], [g for _, g in entries]


def refuse_unimplemented(config: ZeroConfig) -> None:
    """Keys the config reader accepts with DeepSpeed's meaning but this engine does not act on yet: a knob
    that is read and then ignored would train differently from what the user asked, without a word."""
    unimplemented = {
        "zero_optimization.offload_optimizer": config.offload_optimizer.enabled,
        "zero_optimization.offload_param": config.offload_param.enabled,
        "optimizer": config.optimizer is not None, "scheduler": config.scheduler is not None,
        "activation_checkpointing.cpu_checkpointing": config.activation_checkpointing.cpu_checkpointing,
        "activation_checkpointing.partition_activations": config.activation_checkpointing.partition_activations,
        "wall_clock_breakdown": config.wall_clock_breakdown, "comms_logger": config.comms_logger.enabled,
        "flops_profiler": config.flops_profiler.enabled, "csv_monitor": config.csv_monitor.enabled,
        "tensorboard": config.tensorboard.enabled, "wandb": config.wandb.enabled,
        "prescale_gradients": config.prescale_gradients,
        "gradient_predivide_factor": config.gradient_predivide_factor != 1.0,
        "data_types.grad_accum_dtype": config.grad_accum_dtype is not None,
    }
    asked = [key for key, on in unimplemented.items() if on]
    if asked:
        raise ValueError(f"{asked[0]} is read but not yet acted on by this version of zerokit's engine; remove it "
                         "(or turn it off) for now")


def initialize(model: nn.Module, optimizer: Optimizers,
               config: ZeroConfig | Mapping[str, Any] | str | Path | None = None,
               device: torch.device | None = None, param_init: ParamInit | None = None) -> Engine:
    """Wrap `model` and `optimizer` (one, or a list each over its own parameters; `engine.optimizer` is
    then the list, rebuilt in the same order) for ZeRO training. `config` is a ZeroConfig, a DeepSpeed-style
    dict, or the path of a JSON file holding one. Joins torchrun's process group if there is one.
    A model built on the meta device is materialised shard by shard at stage 3, with `param_init(module)`
    filling each module's parameters (default: its reset_parameters()); see zerokit/stages/construction.py."""
    return Engine(model, optimizer, load_config(config), device, param_init)
