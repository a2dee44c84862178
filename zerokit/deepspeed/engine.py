"""DeepSpeed's engine API on zerokit's Engine: what `deepspeed.initialize` returns, so that a script's
`model_engine.backward(loss)`, `model_engine.step()`, `model_engine.local_rank`, ... run unchanged.

DeepSpeedEngine is zerokit's Engine (every zerokit method works on it: memory_stats(), comm_stats(),
unsharded(), ...) plus DeepSpeed's names, counters and conventions:
- step() is called after every micro-step and steps the optimizer at accumulation boundaries (zerokit's
  Engine already does); micro_steps counts step() calls, and is_gradient_accumulation_boundary() answers from
  it as DeepSpeed does, so it is True between the last micro-step's backward and its step().
- global_steps counts accumulation boundaries, skipped ones included; skipped_steps the skipped ones.
- An lr_scheduler passed to initialize() is stepped by the engine at every optimizer step it does not skip,
  as DeepSpeed steps it (See [Note: a scheduler passed to initialize]); assigning engine.lr_scheduler replaces it.
- set_gradient_accumulation_boundary(is_boundary) decides, from then on, whether the next backward ends the
  accumulation window (a short last window at an epoch's end), in place of counting micro-steps; step() then
  steps the optimizer after a backward that ended one. backward(loss, scale_wrt_gas=False) takes the loss as
  already divided. Hugging Face's Trainer (through accelerate) does both, calling step() at boundaries only.
- Learning rates and other hyperparameters a caller sets on the optimizer it passed reach the optimizer that
  trains at the next step (See [Note: a scheduler passed to initialize]): accelerate steps the Trainer's own
  schedule on the optimizer the Trainer built.
- engine.config is the typed config and the DeepSpeed dict given (See [Note: engine.config is both configs]).

[Note: a scheduler passed to initialize]
zerokit rebuilds the user's optimizer over this rank's master pieces, so a scheduler built over the user's
optimizer before initialize() sets learning rates in an optimizer nothing steps. The engine steps that
scheduler where DeepSpeed would and then copies every param group's hyperparameters (lr, betas, momentum,
...) from the user's optimizer to its rebuilt twin, group by group (rebuilding keeps the groups in order):
any scheduler (chained, sequential, one that cycles momentum) then drives the optimizer that trains. A
callable lr_scheduler is called with the rebuilt optimizer, as DeepSpeed calls it with its basic optimizer.
A schedule the engine does not step (accelerate steps the Trainer's LambdaLR itself, on the Trainer's optimizer)
reaches the rebuilt twin the same way: before each optimizer step, every hyperparameter that changed in the
user's optimizer since the last step is copied to its twin (only changed ones, so that a script that sets
engine.optimizer's learning rate itself is not overridden by the user's stale value).
Checkpoints keep that contract across a resume. In DeepSpeed the optimizer passed in is the one that trains, so
its checkpoint holds the hyperparameters the schedule last set, and loading it puts them back into that object.
Here save_checkpoint first copies what changed in the user's optimizer to the twin (a schedule stepped after
the last optimizer step has set the next step's learning rate there only), and load_checkpoint copies the
loaded twin's hyperparameters back into the user's optimizer: a schedule whose own state is loaded apart
(accelerate's load_state, the Trainer's scheduler.pt) sets no learning rate until it next steps, so without
this the first step after a resume took the rate of the step before the save.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from zerokit.checkpoint.newest import nothing_named
from zerokit.config.typed import ZeroConfig
from zerokit.deepspeed.config_queries import ConfigQueries
from zerokit.deepspeed.module_view import ModuleView
from zerokit.deepspeed.config_view import EngineConfig
from zerokit.deepspeed.data import training_loader
from zerokit.engine.engine import Engine
from zerokit.precision.result import StepResult
from zerokit.reliability.compiled import compile_model
from zerokit.comm.process import open_engines
from zerokit.stages.construction import ParamInit
from zerokit._support.log import logger

SCHEDULES_KEY = "zerokit.lr_schedules"  # where earlier checkpoints of the drop-in kept its LR schedules


def live_engines() -> list["DeepSpeedEngine"]:
    """Engines made by initialize() and not destroyed, oldest first (runtime's registry of open engines)."""
    return [engine for engine in open_engines() if isinstance(engine, DeepSpeedEngine)]


class ClientSchedule:
    """A scheduler passed to initialize(), stepped by the engine like the `scheduler` block's schedule. See
    [Note: a scheduler passed to initialize]."""

    def __init__(self, scheduler: Any, pairs: list[tuple[torch.optim.Optimizer, torch.optim.Optimizer]],
                 train_batch_size: int) -> None:
        self.scheduler, self.pairs, self.train_batch_size = scheduler, pairs, train_batch_size
        self.kwargs: dict[str, Any] = {}  # engine.step(lr_kwargs=...) for the next step
        self.mirror()

    def step(self) -> None:
        with warnings.catch_warnings():  # the user's optimizer is stepped through its rebuilt twin, never itself
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            try:
                self.scheduler.step(**self.kwargs)
            except TypeError:  # DeepSpeed's fallback, for schedulers that want the batch size
                self.scheduler.step(self.train_batch_size)
        self.mirror()

    def mirror(self) -> None:
        for source, target in self.pairs:
            for given, rebuilt in zip(source.param_groups, target.param_groups, strict=True):
                rebuilt.update({key: value for key, value in given.items() if key != "params"})

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The scheduler's own state only: a checkpoint load then copies the loaded optimizer's hyperparameters
        to the user's (HyperparameterMirror.adopt_loaded), never the other way round."""
        self.scheduler.load_state_dict(state)


class HyperparameterMirror:
    """Copies what changed in the user's optimizers' param groups to their rebuilt twins. See [Note: a scheduler
    passed to initialize]."""

    def __init__(self, pairs: list[tuple[torch.optim.Optimizer, torch.optim.Optimizer]]) -> None:
        self.pairs = pairs
        self.seen = [self._settings(user) for user, _ in pairs]

    @staticmethod
    def _settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]

    def sync(self) -> None:
        for index, (user, twin) in enumerate(self.pairs):
            now = self._settings(user)
            for before, after, rebuilt in zip(self.seen[index], now, twin.param_groups, strict=True):
                rebuilt.update({key: value for key, value in after.items() if before.get(key, object()) != value})
            self.seen[index] = now

    def adopt_loaded(self) -> None:
        """The twins' hyperparameters (just loaded from a checkpoint) become the user's optimizers' too."""
        for index, (user, twin) in enumerate(self.pairs):
            for given, rebuilt in zip(user.param_groups, twin.param_groups, strict=True):
                given.update({key: rebuilt[key] for key in given if key != "params" and key in rebuilt})
            self.seen[index] = self._settings(user)


class DeepSpeedEngine(ConfigQueries, ModuleView, Engine):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None,
                 config: ZeroConfig, model_parameters: Iterable[Any] | None = None, lr_scheduler: Any = None,
                 collate_fn: Callable | None = None, param_init: ParamInit | None = None,
                 given_config: dict[str, Any] | None = None) -> None:
        self._given_config = dict(given_config or {})  # before Engine sets self.config; See the config property
        super().__init__(model, optimizer, config, param_init=param_init, model_parameters=model_parameters)
        self.local_rank, self.global_rank = int(os.environ.get("LOCAL_RANK", 0)), self.rank
        self.micro_steps = 0
        self.collate_fn = collate_fn
        self.training_dataloader: torch.utils.data.DataLoader | None = None
        self._last_boundary: StepResult | None = None
        self._step_applied = False
        self._is_compiled = False
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's answer; None: count micro-steps
        self._given_optimizer = optimizer
        users = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self._mirror = HyperparameterMirror([(user, twin) for user, twin in zip(users, self.view.optimizers)
                                             if isinstance(user, torch.optim.Optimizer) and user is not twin])
        self._client_schedule = self._attach(lr_scheduler, optimizer)
        self.show_zero3_names()  # what DeepSpeed's callers (TRL) read off a ZeRO-3 model (ModuleView)

    def _attach(self, scheduler: Any, given: Any) -> ClientSchedule | None:
        if scheduler is None:
            return None
        if callable(scheduler) and (isinstance(scheduler, type) or not hasattr(scheduler, "step")):
            scheduler = scheduler(self.optimizer)  # DeepSpeedSchedulerCallable: over the optimizer that trains
        users = list(given) if isinstance(given, (list, tuple)) else [given]
        rebuilt = self.view.optimizers
        driven = getattr(scheduler, "optimizer", None)
        pairs = [(user, twin) for user, twin in zip(users, rebuilt) if user is driven and user is not twin]
        schedule = ClientSchedule(scheduler, pairs, self.train_batch_size())
        self.lr_schedules.append(schedule)
        return schedule

    @property
    def config(self) -> EngineConfig:
        """The typed config, also read as the DeepSpeed dict given (See [Note: engine.config is both configs])."""
        return self._config

    @config.setter
    def config(self, typed: ZeroConfig) -> None:
        self._config = EngineConfig.of(typed, self._given_config)

    # --- DeepSpeed's training calls --------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss`, divided by gradient_accumulation_steps unless scale_wrt_gas=False (the caller
        divided it); returns the loss backpropagated, as DeepSpeed."""
        if retain_graph:
            raise ValueError("engine.backward(loss, retain_graph=True) is not offered: zerokit frees the graph as it "
                             "reduces each micro-step's gradients; run a second forward instead")
        if loss.numel() != 1:
            raise ValueError(f"engine.backward(loss) needs a scalar loss, not one of shape {tuple(loss.shape)}")
        super().backward(loss, average_window=scale_wrt_gas)
        return loss.detach() / self.config.gradient_accumulation_steps if scale_wrt_gas else loss.detach()

    @property
    def at_boundary(self) -> bool:
        """The next backward ends an accumulation window: as set_gradient_accumulation_boundary said last, else
        counted from micro-steps."""
        return super().at_boundary if self._boundary is None else self._boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """From now on, whether the next backward ends the accumulation window (DeepSpeed keeps the setting until
        it is set again). A short window (an epoch's last) steps on the micro-steps it has."""
        self._boundary = bool(is_boundary)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> StepResult:
        """Call after every micro-step's backward; the optimizer steps at accumulation boundaries."""
        if self._client_schedule is not None:
            self._client_schedule.kwargs = dict(lr_kwargs or {})
        if self.progress.window_ended:
            self._mirror.sync()  # See [Note: a scheduler passed to initialize]
        result = super().step()
        self.micro_steps += 1
        self._step_applied = result.stepped
        if result.boundary:
            self._last_boundary = result
        return result

    def zero_grad(self) -> None:
        """Nothing to zero between optimizer steps: zerokit releases gradients after each one. Inside an
        accumulation window it would drop gradients already accumulated (or reduced), so it refuses."""
        if self.progress.micro_step and not self.progress.window_ended:
            raise RuntimeError("engine.zero_grad() inside an accumulation window would drop the gradients of its "
                               "micro-steps so far; zerokit clears gradients itself after each optimizer step")

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last accumulation boundary."""
        return self._last_boundary.grad_norm if self._last_boundary else None

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: betas for Adam-like optimizers, momentum otherwise."""
        return [group.get("betas", group.get("momentum", 0.0))
                for optimizer in self.view.optimizers for group in optimizer.param_groups]

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler passed to initialize() (or assigned), else the `scheduler` block's (None without either)."""
        return self._client_schedule.scheduler if self._client_schedule is not None else super().lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        """Replace the schedule the engine steps (None: the engine steps none), as assigning DeepSpeed's does."""
        self.lr_schedules.clear()
        self._client_schedule = self._attach(scheduler, self._given_optimizer)

    # --- counters and settings -----------------------------------------------------------------------
    def get_wall_clock_timers(self) -> dict[str, float]:
        """The last optimizer step's phase times in ms (with wall_clock_breakdown)."""
        return self.monitor.wall_clock_times

    # --- data, compilation, checkpoints, teardown -------------------------------------------------------
    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train", pin_memory: bool = True,
                     data_sampler: Any = None, collate_fn: Callable | None = None,
                     num_local_io_workers: int | None = None) -> torch.utils.data.DataLoader:
        """This rank's share of `dataset` at the micro-batch size, in DeepSpeed's order (eval routes unshuffled); the
        first training loader's position is saved and restored by checkpoints (See zerokit/deepspeed/data.py)."""
        return training_loader(dataset, batch_size or self.train_micro_batch_size_per_gpu(), self.rank,
                               self.world_size, drop_last=self.config.dataloader_drop_last, sampler=data_sampler,
                               collate_fn=collate_fn or self.collate_fn, workers=num_local_io_workers or 0,
                               shuffle=route == "train", position=self.data_position if route == "train" else None)

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """torch.compile the wrapped module in place (nn.Module.compile), as DeepSpeed's engine.compile() does, at
        every stage: zerokit's hooks stay eager (See [Note: torch.compile and zerokit's hooks] in
        zerokit/reliability/compiled.py, which also refuses fullgraph=True around a stage-3 unit). DeepSpeed
        ignores a `backend` inside compile_kwargs in favour of the argument; so does this."""
        if schedule is not None:
            raise ValueError("engine.compile(schedule=...) asks for DeepCompile, which zerokit does not offer; call "
                             "engine.compile() without a schedule for torch.compile")
        if compiled_autograd_enabled:
            raise ValueError("engine.compile(compiled_autograd_enabled=True) is not offered: zerokit's gradient "
                             "hooks drive its reductions and need eager autograd")
        if self._is_compiled:
            return
        compile_model(self, backend, **{k: v for k, v in (compile_kwargs or {}).items() if k != "backend"})
        self._is_compiled = True

    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False, **zerokit: Any) -> bool:
        """DeepSpeed's save_checkpoint on zerokit's (every rank calls it), which saves the LR schedules the engine
        steps too. exclude_frozen_parameters only makes DeepSpeed's files smaller: a zerokit
        checkpoint holds every parameter, so that it resumes at any world size and stage, and says so."""
        if exclude_frozen_parameters and any(not param.requires_grad for param in self.module.parameters()):
            logger.info("save_checkpoint(exclude_frozen_parameters=True): zerokit keeps the frozen parameters in the "
                        "checkpoint too (it resumes at any world size and stage)")
        self._mirror.sync()  # See [Note: a scheduler passed to initialize]
        return super().save_checkpoint(save_dir, tag, client_state, save_latest=save_latest, **zerokit)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Callable | None = None,
                        **zerokit: Any) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's load_checkpoint on zerokit's: (load_path, client_state); (None, None) without `latest`, too."""
        if tag is None and nothing_named(load_dir):
            return None, None
        if not load_module_strict or custom_load_fn is not None:
            raise ValueError("load_checkpoint(load_module_strict=False / custom_load_fn=...) is not offered: zerokit "
                             "loads every parameter of the model by name")
        from zerokit.checkpoint import load_checkpoint  # Engine.load_checkpoint's, with the scheduler flag
        self._refuse_if_closed("load_checkpoint")
        path, client_state = load_checkpoint(
            self.loaded_by(load_dir, tag), load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only, load_lr_scheduler_states=load_lr_scheduler_states, **zerokit)
        if load_optimizer_states and not load_module_only:
            self._mirror.adopt_loaded()  # before the schedules' mirror: See [Note: a scheduler passed to initialize]
        client_state = dict(client_state or {})
        saved = client_state.pop(SCHEDULES_KEY, None)  # where zerokit 0.1.0 kept them, before the checkpoint did
        if saved is not None and load_lr_scheduler_states and not load_module_only:
            for schedule, state in zip(self.lr_schedules, saved, strict=True):
                schedule.load_state_dict(state)
        return path, client_state

    def offload_states(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("engine.offload_states() is out of scope for zerokit: it keeps model states where "
                                  "zero_optimization.offload_optimizer/offload_param put them for the whole run")

    def reload_states(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("engine.reload_states() is out of scope for zerokit: nothing was offloaded")

    def destroy(self) -> None:
        """DeepSpeed's name for close()."""
        self.close()


__all__ = ["DeepSpeedEngine", "ClientSchedule", "live_engines"]
