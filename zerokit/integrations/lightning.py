"""Lightning's Trainer on zerokit: a strategy object, or a registered name once this module is imported.

    import zerokit.integrations.lightning  # registers "zerokit_stage_1", "zerokit_stage_2", "zerokit_stage_3"
    from zerokit.integrations.lightning import ZerokitStrategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=ZerokitStrategy(config="ds_config.json"),
                      precision="bf16-mixed", accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zerokit_stage_3")

`config` is what zerokit.initialize takes (a DeepSpeed-style dict, the path of a JSON file holding one, or a typed
zerokit.ZeroConfig): every key zerokit reads works here. The Trainer owns what it already has an argument for,
and the config must agree with it or leave it out (a disagreement is a one-line error, never a silent choice):
`accumulate_grad_batches` (gradient_accumulation_steps), `gradient_clip_val` (gradient_clipping, by the global
norm; clipping by value is refused) and `precision` ("32-true"; "bf16-mixed": bf16 compute with fp32 masters;
"16-mixed": fp16 with dynamic loss scaling, or the config's fp16 block). The LightningModule's
configure_optimizers gives the optimizer and LR schedules, unless the config has an `optimizer` block (then the
engine builds it, and steps the config's `scheduler` itself). Lightning's own DeepSpeed strategy refuses CPUs;
this one trains wherever zerokit does.

[Note: Lightning ends the accumulation windows]
Lightning decides when an optimizer step happens: after `accumulate_grad_batches` micro-batches, and at an
epoch's last batch whatever the count (a short last window). It divides each loss by `accumulate_grad_batches`
itself, and it calls the optimizer step, with the closure that runs training_step and backward, only at a window's
end. So the strategy tells Lightning it does not handle accumulation, the engine takes the loss as divided
(backward(average_window=False)), and a backward ends a window exactly when it runs inside the optimizer step's
closure (ZerokitPrecision.optimizer_step sets `engine.ends_window` around it). The gradients a window reduces,
clips and steps on are then those DDP would, micro-batch for micro-batch.
An epoch can also end inside a window, with no step: on_train_batch_start returning -1 ends it at once. Its
gradients stay, and Lightning saves its epoch-end checkpoint there; at the next window's first batch (batch_idx
a multiple of accumulate_grad_batches, counted per epoch) Lightning calls optimizer.zero_grad(), which drops
them under DDP. The optimizer Lightning holds is not the one that trains, so the strategy drops them itself at
that batch (LightningEngine.begin_window), and saves inside a window as DDP does, without its gradients (See
[Note: a save inside an accumulation window] in zerokit/checkpoint/save.py).

[Note: the LightningModule's optimizer and the one that trains]
zerokit rebuilds the optimizer configure_optimizers returns over this rank's master pieces; the one Lightning
holds (and its LR schedules step, and LearningRateMonitor reads) stays the user's. Before every optimizer step the
engine copies what changed in the user's param groups (lr, betas, ...) to the one that trains, as the DeepSpeed
drop-in does for the schedules Hugging Face steps (See [Note: a scheduler passed to initialize] in
zerokit/deepspeed/engine.py); before a checkpoint is saved too, so that the saved groups are the user's current
ones. A resumed run copies them back into the user's optimizer, so a schedule that reads them (LinearLR, StepLR)
continues from the saved values, as it would after DDP restored the optimizer's state dict.

[Note: Lightning checkpoints on zerokit]
`trainer.save_checkpoint(path)` (and ModelCheckpoint) writes a zerokit checkpoint directory at `path` (tag
"checkpoint"): every rank its shards, with Lightning's own state (loops, callbacks, LR schedules, hyperparameters)
as its client state; `fit(ckpt_path=path)` resumes from it exactly, at any world size and stage. With
`weights_only=True` it writes one ordinary Lightning file instead, whose "state_dict" is the whole model
(engine.full_state_dict(): gathered one unit at a time at stage 3), loadable into the plain module. Lightning asks
for the state dict before it says which of the two it is saving, so every save gathers it once (the model's size
in host memory on every rank, for the duration of the save). A single-file checkpoint holds no sharded
optimizer state, so fit(ckpt_path=file) is refused; validate/test/predict load its weights.

[Note: configure_model at stage 3]
Lightning calls the LightningModule's configure_model() inside strategy.model_sharded_context(); its DeepSpeed
strategy enters zero.Init there, so that a model too large for one rank is never whole. At stage 3 this one enters
zerokit's zero.Init: each parameter goes to the meta device as its module registers it (See [Note: zero.Init is
meta construction] in zerokit/deepspeed/zero.py), and the engine fit() starts materialises them one unit at a
time with `param_init` (ZerokitStrategy(param_init=fn); default: each module's reset_parameters()), the same on
every rank, which the engine checks. As with zero.Init, a constructor's own initialisation of parameters does not
survive the meta device: give it as param_init. Stages 1 and 2 hold whole parameters, so configure_model builds
as usual there.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from zerokit.config.typed import LossScaling, ZeroConfig, load_config
from zerokit._support.extras import MissingExtra, installed, missing_message

if not installed("lightning"):  # the module IS the feature: refused in one line naming the extra
    raise MissingExtra(missing_message("lightning", "zerokit.integrations.lightning"))

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout  # noqa: E402
from lightning.fabric.utilities.apply_func import apply_to_collection  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers  # noqa: E402
from lightning.pytorch.overrides.distributed import _sync_module_states  # noqa: E402
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402
from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402

from zerokit.deepspeed.engine import HyperparameterMirror  # noqa: E402
from zerokit.deepspeed.zero import Init  # noqa: E402
from zerokit.engine.engine import Engine  # noqa: E402
from zerokit.precision.result import StepResult  # noqa: E402
from zerokit.stages.construction import ParamInit  # noqa: E402

TAG = "checkpoint"  # the tag inside a checkpoint directory, as Lightning's DeepSpeed strategy names it
COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
LIGHTNING_PLUGINS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)  # Lightning's picks for precision=


class LightningEngine(Engine):
    """zerokit's Engine with its accumulation windows ended by Lightning (See [Note: Lightning ends the
    accumulation windows]) and its hyperparameters taken from the LightningModule's optimizer (See [Note: the
    LightningModule's optimizer and the one that trains])."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, config: ZeroConfig,
                 device: torch.device, param_init: ParamInit | None = None) -> None:
        self.ends_window = False  # True while the closure of Lightning's optimizer step runs
        super().__init__(module, optimizer, config, device=device, param_init=param_init)
        trains = self.view.optimizers[0]
        self.mirror = HyperparameterMirror([(optimizer, trains)] if optimizer not in (None, trains) else [])
        self.last_step: StepResult | None = None  # the last optimizer step's result: grad norm, clipped, skipped

    @property
    def at_boundary(self) -> bool:
        return self.ends_window

    def step(self) -> StepResult:
        if self.progress.window_ended:
            self.mirror.sync()
        self.last_step = super().step()
        return self.last_step

    def begin_window(self) -> None:
        """A window's first batch, where Lightning zeroes the gradients: those of a window it ended without a step
        are dropped. See [Note: Lightning ends the accumulation windows]."""
        if self.progress.inside_window:
            self.stage.drop_window()
            self.progress = self.progress.without_window()

    def adopt_restored_hyperparameters(self) -> None:
        """After a load: the user's optimizer takes the param groups the training one was restored with."""
        self.mirror.adopt_loaded()


def engine_of(module: LightningModule) -> LightningEngine:
    engine = getattr(module.trainer.strategy, "engine", None)
    if engine is None:
        raise RuntimeError("ZerokitPrecision trains through ZerokitStrategy's engine; use it with "
                           "Trainer(strategy=ZerokitStrategy(...)) or a 'zerokit_stage_*' name, inside fit()")
    return engine


class ZerokitPrecision(Precision):
    """Lightning's precision argument on zerokit's engine, which keeps fp32 masters and scales fp16 losses
    itself: backward and the optimizer step go to the engine, inputs are cast to the compute dtype, and
    clipping happens inside the engine's step (by the global norm across ranks)."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in COMPUTE_DTYPES:
            raise ValueError(f"precision={precision!r} is not offered by ZerokitStrategy; use one of "
                             f"{', '.join(map(repr, COMPUTE_DTYPES))} (zerokit keeps fp32 master weights, so the "
                             "16-bit kinds are the '-mixed' ones)")
        self.precision = precision
        self.compute_dtype = COMPUTE_DTYPES[precision]

    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs in the dtype the engine's parameters compute in."""
        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(self.compute_dtype) if tensor.is_floating_point() else tensor
        return apply_to_collection(data, torch.Tensor, cast)

    def backward(self, tensor: torch.Tensor, model: LightningModule, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        if args or kwargs:
            raise ValueError("manual_backward(loss, ...) arguments are not offered by ZerokitStrategy: its engine "
                             "runs backward itself (with the fp16 loss scale); call it with the loss alone")
        # Lightning divided the loss by accumulate_grad_batches: See [Note: Lightning ends the accumulation windows]
        engine_of(model).backward(tensor, average_window=False)

    def optimizer_step(self, optimizer: Any, model: LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> StepResult:
        if kwargs:
            raise ValueError(f"optimizer.step({', '.join(kwargs)}=...) is not offered by ZerokitStrategy: the engine "
                             "steps the optimizer it rebuilt over this rank's shard")
        engine = engine_of(model)
        engine.ends_window = True  # See [Note: Lightning ends the accumulation windows]
        try:
            closure_result = closure()
        finally:
            engine.ends_window = False
        self._after_closure(model, optimizer)
        if closure_result is None:
            raise ValueError("training_step returned None (skip this batch): ZerokitStrategy cannot skip a batch "
                             "that ends an accumulation window, since every rank must reduce its gradients")
        return engine.step()

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Nothing here: the engine clips at its step, by the global norm of the reduced gradients, at the
        Trainer's gradient_clip_val (ZerokitStrategy wrote it into the engine's config)."""


def as_zerokit_precision(plugin: Precision) -> ZerokitPrecision:
    """The plugin Lightning made for Trainer(precision=...), as ZerokitPrecision."""
    if isinstance(plugin, ZerokitPrecision):
        return plugin
    if type(plugin) in LIGHTNING_PLUGINS:
        return ZerokitPrecision(plugin.precision)
    raise ValueError(f"the precision plugin {type(plugin).__name__} is not offered by ZerokitStrategy; use "
                     "Trainer(precision='32-true' | 'bf16-mixed' | '16-mixed') or ZerokitPrecision")


# --- the config: what the user gave, then what the Trainer owns ------------------------------------------

def given_config(config: ZeroConfig | Mapping[str, Any] | str | Path | None,
                 stage: int | None) -> ZeroConfig | dict[str, Any]:
    """The config as given (a JSON file read to its dict), with `stage` written in; checked now, so that a bad
    key fails when the strategy is made, not after the processes start."""
    if config is None and stage is None:
        raise ValueError("ZerokitStrategy needs a config (a DeepSpeed-style dict, a JSON path or a ZeroConfig) or "
                         "a stage: ZerokitStrategy(stage=2), ZerokitStrategy(config={...})")
    typed = load_config(config)  # one-line errors for a missing file, bad JSON, unknown keys
    if stage is not None and typed.stage not in (0, stage):
        raise ValueError(f"ZerokitStrategy(stage={stage}) but the config's zero_optimization.stage is {typed.stage}; "
                         "give one of them")
    if isinstance(config, ZeroConfig):
        return config if stage is None else replace(config, stage=stage)
    raw = json.loads(Path(config).read_text()) if isinstance(config, (str, Path)) else dict(config or {})
    if stage is not None:
        raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "stage": stage}
    load_config(raw)
    return raw


def _given_value(config: ZeroConfig | dict[str, Any], key: str, unset: Any) -> Any:
    """What the config says for a top-level key, or None where it leaves the choice to the Trainer."""
    if isinstance(config, ZeroConfig):
        value = getattr(config, key)
        return None if value == unset else value
    value = config.get(key)
    return None if value == "auto" else value


def _agreed(config: ZeroConfig | dict[str, Any], key: str, trainer_arg: str, trainer_value: Any, unset: Any) -> Any:
    """The Trainer's value where it gives one, else the config's; refused where both give different ones (the
    Trainer's argument decides what Lightning itself does, so the config cannot override it in silence)."""
    given = _given_value(config, key, unset)
    if given is not None and trainer_value is not None and given != trainer_value:
        raise ValueError(f"the config's {key}={given} and Trainer({trainer_arg}={trainer_value}) disagree; set "
                         f"Trainer({trainer_arg}=...) and leave {key} out of the config (or give both the same)")
    return given if trainer_value is None else trainer_value


def engine_config(config: ZeroConfig | dict[str, Any], precision: str, accumulation: int,
                  clip: float | None) -> ZeroConfig:
    """The engine's config: the user's, with the accumulation, clipping and compute dtype the Trainer owns."""
    accumulation = _agreed(config, "gradient_accumulation_steps", "accumulate_grad_batches", accumulation, 1)
    clip = _agreed(config, "gradient_clipping", "gradient_clip_val", clip or None, 0.0) or 0.0
    typed = load_config(config)
    dtype, configured = COMPUTE_DTYPES[precision], typed.precision.param_dtype
    if configured not in (torch.float32, dtype):
        raise ValueError(f"the config computes in {configured} but Trainer(precision={precision!r}); set the "
                         "Trainer's precision to match ('bf16-mixed', '16-mixed') or remove the config's block")
    if isinstance(config, ZeroConfig):
        scaling = config.loss_scaling or (LossScaling() if dtype == torch.float16 else None)
        return replace(config, gradient_accumulation_steps=accumulation, gradient_clipping=clip,
                       precision=replace(config.precision, param_dtype=dtype), loss_scaling=scaling)
    raw = {**config, "gradient_accumulation_steps": accumulation, "gradient_clipping": clip}
    if dtype != configured:  # the config has no 16-bit block: the Trainer's precision adds DeepSpeed's
        raw["bf16" if dtype == torch.bfloat16 else "fp16"] = {"enabled": True}
    return load_config(raw)


def check_trainer(trainer: Trainer, module: LightningModule) -> None:
    """What Lightning offers that a sharded engine cannot do as asked: refused in one line each."""
    if not module.automatic_optimization:
        raise ValueError("ZerokitStrategy trains with automatic optimization (the engine steps at the windows "
                         "Lightning ends); set automatic_optimization back to True")
    if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise ValueError("gradient_clip_algorithm='value' is not offered by ZerokitStrategy: gradients are sharded "
                         "across ranks and clipped by their global norm; use gradient_clip_algorithm='norm'")
    if is_overridden("configure_gradient_clipping", module, LightningModule):
        raise ValueError("configure_gradient_clipping is overridden, but ZerokitStrategy clips inside its engine "
                         "(by the global norm); remove the override and set Trainer(gradient_clip_val=...)")


# --- the strategy -----------------------------------------------------------------------------------------

class ZerokitStrategy(DDPStrategy):
    """ZeRO stages 1-3 (and zerokit's offload, checkpoints, observability) for Lightning's Trainer. `config`:
    a DeepSpeed-style dict, the path of a JSON file, or a zerokit.ZeroConfig; `stage` writes its ZeRO stage
    (the registered names pass it). `param_init`: how stage 3 initialises a model configure_model() built on the
    meta device (See [Note: configure_model at stage 3]); a model built with real parameters keeps them. The
    engine is `strategy.engine` (a zerokit Engine) once fit() sets it up."""

    strategy_name = "zerokit"

    def __init__(self, config: ZeroConfig | Mapping[str, Any] | str | Path | None = None, stage: int | None = None,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, param_init: ParamInit | None = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.config = given_config(config, stage)
        self.param_init = param_init
        self.engine: LightningEngine | None = None

    @property
    def precision_plugin(self) -> ZerokitPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZerokitPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning builds the plugin from Trainer(precision=...) and sets it here; it becomes the engine's.
        self._precision_plugin = None if plugin is None else as_zerokit_precision(plugin)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # See [Note: Lightning ends the accumulation windows]

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint loads into the engine's shards

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer state

    # --- set-up ---
    def setup(self, trainer: Trainer) -> None:
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._start_engine(trainer)
        elif self.engine is None:  # evaluation without training: the plain module, rank 0's weights everywhere
            self.model_to_device()
            _sync_module_states(self.model)
        self.setup_precision_plugin()

    def _start_engine(self, trainer: Trainer) -> None:
        if self.engine is not None:
            raise RuntimeError("this ZerokitStrategy already trained its module; give each fit() a new strategy")
        module = self.lightning_module
        check_trainer(trainer, module)
        if self._layer_sync:  # Trainer(sync_batchnorm=True), as DDP applies it
            self.model = self._layer_sync.apply(self.model)
        config = engine_config(self.config, self.precision_plugin.precision, trainer.accumulate_grad_batches,
                               trainer.gradient_clip_val)
        optimizer, self.lr_scheduler_configs = None, []
        if config.optimizer is None:  # else the config's optimizer block: the engine builds it
            optimizer, self.lr_scheduler_configs = self._module_optimizer(module)
        on_meta = any(param.is_meta for param in module.parameters())  # See [Note: configure_model at stage 3]
        self.engine = LightningEngine(module, optimizer, config, self.root_device,
                                      param_init=self.param_init if on_meta else None)
        self.optimizers = [optimizer] if optimizer is not None else list(self.engine.view.optimizers)

    @staticmethod
    def _module_optimizer(module: LightningModule) -> tuple[torch.optim.Optimizer, list[Any]]:
        optimizers, schedules = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise ValueError(f"configure_optimizers gave {len(optimizers)} optimizers; ZerokitStrategy trains with one "
                             "(automatic optimization steps one), or with the config's optimizer block")
        return optimizers[0], schedules

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Around configure_model(): at stage 3 its parameters are built on the meta device. See [Note:
        configure_model at stage 3]."""
        with Init(config_dict_or_path=self.config):
            yield

    def on_train_start(self) -> None:
        """The preemption block's signals back to the engine: Lightning installs its own SIGTERM handler after the
        strategy's setup, which runs a collective inside the handler (See PreemptionWatcher.take_signals_back)."""
        super().on_train_start()
        if self.engine is not None:
            self.engine.preemption.take_signals_back()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.engine is not None and batch_idx % self.lightning_module.trainer.accumulate_grad_batches == 0:
            self.engine.begin_window()  # See [Note: Lightning ends the accumulation windows]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """training_step through the engine's forward (its observability: forward time, FLOPs)."""
        with self.precision_plugin.train_step_context():
            return self._forward_redirection(self.engine, self.lightning_module, "training_step", *args, **kwargs)

    # --- checkpoints: See [Note: Lightning checkpoints on zerokit] ---
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return super().lightning_module_state_dict()
        return self.engine.full_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        if self.engine is None or "optimizer_states" not in checkpoint:  # weights only: one ordinary file
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("save_checkpoint(storage_options=...) is not offered for a sharded checkpoint: every rank "
                            "writes its own files with zerokit's writer")
        filepath = self.broadcast(str(filepath))
        self.engine.mirror.sync()  # See [Note: the LightningModule's optimizer and the one that trains]
        held_by_engine = ("state_dict", "optimizer_states")  # its shards hold them
        client_state = {key: value for key, value in checkpoint.items() if key not in held_by_engine}
        self.engine.save_checkpoint(filepath, tag=TAG, client_state=client_state, within_window=True)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if not path.is_dir():
            if fitting:
                raise ValueError(f"fit(ckpt_path={str(path)!r}): a single-file checkpoint holds no sharded optimizer "
                                 "state to resume; resume from the directory ZerokitStrategy saved, or load the "
                                 "weights into the module before fit()")
            return super().load_checkpoint(path, weights_only)
        if self.engine is None:
            raise ValueError(f"{path} is a zerokit checkpoint, which loads into the engine fit() makes; to evaluate "
                             "its weights, save them with trainer.save_checkpoint(..., weights_only=True) or "
                             "`zerokit consolidate`")
        from zerokit.checkpoint import load_checkpoint

        _, client_state = load_checkpoint(self.engine, path, TAG, load_optimizer_states=fitting,
                                          weights_only=True if weights_only is None else weights_only)
        self.engine.adopt_restored_hyperparameters()
        return dict(client_state or {})

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" not in checkpoint:  # a zerokit directory: the engine loaded its shards already
            return
        if self.engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        with self.engine.unsharded(write_back=True):  # every rank writes the same weights, masters included
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: the engine's checkpoint restored its optimizer."""

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield  # the engine reduces when and what its stage needs

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in (1, 2, 3):
            strategy_registry.register(f"zerokit_stage_{stage}", cls, description=f"zerokit ZeRO stage {stage}",
                                       override=True, stage=stage)


ZerokitStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZerokitStrategy", "ZerokitPrecision", "LightningEngine", "engine_config"]
