"""`deepspeed.initialize` and `deepspeed.add_config_arguments` for zerokit, with DeepSpeed's arguments, checks
and messages.

    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(args=args, model=model,
        model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")

The config comes from `config` (a dict or a JSON path; `config_params` is its old name) or from
`args.deepspeed_config` (`--deepspeed_config`, or set in code), not both, as in DeepSpeed. The optimizer is
the one passed (an optimizer, or a callable taking model_parameters), or the config's `optimizer` block's over
model_parameters (default: the model's trainable parameters); the schedule is lr_scheduler (a scheduler, or a
callable taking the optimizer) or the `scheduler` block's. Passing an optimizer (or lr_scheduler) and having
a block for it too is an error: DeepSpeed 0.19.8 silently prefers the object, zerokit will not guess.

[Note: the drop-in clips as DeepSpeed does]
DeepSpeed 0.19.8 clips the global gradient norm at 1.0 when a config has no gradient_clipping
(runtime/constants.py GRADIENT_CLIPPING_DEFAULT, applied by its ZeRO optimizers); zerokit's own default is no
clipping. Scripts and frameworks that call deepspeed.initialize were tuned on DeepSpeed's meaning: Hugging
Face's Trainer hands clipping to the engine (accelerate's clip_grad_norm_ only reads the engine's norm back) and
fills gradient_clipping from max_grad_norm (default 1.0) only where the config says "auto", so a config without
the key clips at 1.0 under DeepSpeed and under the Trainer's own DDP loop alike. So initialize() here reads an
absent gradient_clipping as 1.0 and says so at start-up; zerokit.initialize keeps zerokit's default.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from zerokit.checkpoint.newest import resume_from_newest
from zerokit.config.typed import ZeroConfig, load_config
from zerokit.deepspeed.autotp import merge_recorded
from zerokit.deepspeed.config_view import config_dict
from zerokit.deepspeed.distributed import init_distributed
from zerokit.deepspeed.engine import DeepSpeedEngine
from zerokit.engine.schedules import both_given_error
from zerokit.stages.construction import ParamInit
from zerokit.integrations.hf_trainer import stream_trainer_saves
from zerokit.checkpoint.locate import layout_directory
from zerokit._support.log import logger


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's argument group: --deepspeed, --deepspeed_config and their deprecated --deepscale forms."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration "
                       "file.")
    return parser


def config_source(args: Any, config: Any, config_params: Any) -> dict[str, Any] | str | Path | ZeroConfig:
    """The config as DeepSpeed finds it: `config`, else `config_params`, else args.deepspeed_config (or the
    deprecated args.deepscale_config); two of them is an error."""
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:
        if getattr(args, "deepspeed_config", None) is not None:
            raise ValueError("Not sure how to proceed, we were given both a deepscale_config and deepspeed_config")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ValueError("Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments "
                             "and deepspeed.initialize() function call")
        config = args.deepspeed_config
    if config is None:
        raise ValueError("DeepSpeed requires --deepspeed_config to specify configuration file")
    return config


def deepspeed_defaults(source: Any) -> Any:
    """The DeepSpeed config with DeepSpeed's meaning for an absent gradient_clipping: 1.0. See [Note: the
    drop-in clips as DeepSpeed does]. A ZeroConfig is zerokit's own and stays as it is."""
    given = config_dict(source)
    if not given or "gradient_clipping" in given:
        return source
    if int(os.environ.get("RANK", 0)) == 0:
        logger.info("gradient_clipping not set: deepspeed.initialize clips at 1.0, as DeepSpeed 0.19.8 does "
                    "(zerokit.initialize does not clip); set gradient_clipping: 0 for no clipping")
    return {**given, "gradient_clipping": 1.0}


def recorded_tensor_parallel(source: Any) -> Any:
    """The config with a deepspeed.tp_model_init call merged into it (See [Note: tp_model_init records, initialize
    splits] in autotp.py); a ZeroConfig takes the degree as its autotp_size."""
    if isinstance(source, ZeroConfig):
        merged = merge_recorded({"tensor_parallel": {"autotp_size": source.autotp_size}} if source.autotp_size > 1
                                else {})
        degree = merged.get("tensor_parallel", {}).get("autotp_size", source.autotp_size)
        return source if degree == source.autotp_size else replace(source, autotp_size=degree)
    given = config_dict(source)
    merged = merge_recorded(given)
    return source if merged is given else merged


def check_local_rank(args: Any) -> int:
    """DeepSpeed's check that args.local_rank, when a script sets it, agrees with LOCAL_RANK; then
    args.local_rank is set to it, as DeepSpeed does. Returns the local rank."""
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError("DeepSpeed requires the LOCAL_RANK environment variable, it is set by the deepspeed "
                           "launcher, deepspeed.init_distributed, or the torch's launcher. If using a different "
                           "launcher please ensure LOCAL_RANK is set prior to initializing deepspeed.")
    local_rank = int(os.environ["LOCAL_RANK"])
    given = getattr(args, "local_rank", None)
    if given is not None:
        if not isinstance(given, int):
            raise ValueError(f"args.local_rank of {given} is an unknown type {type(given)}")
        if given >= 0 and given != local_rank:
            raise ValueError(f"Mismatch in local rank setting, args.local_rank={given} but "
                             f"env['LOCAL_RANK']={local_rank}.")
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local_rank
    return local_rank


def _is_pipeline_module(model: nn.Module) -> bool:
    import sys
    pipe = sys.modules.get("zerokit.deepspeed.pipe")  # not imported: no PipelineModule was built
    return pipe is not None and isinstance(model, pipe.PipelineModule)


def with_sequence_of(typed: ZeroConfig, mpu: Any, model: nn.Module) -> ZeroConfig:
    """The config with the sequence degree of an ALST mpu (from register_with_transformers), which the config's
    sequence_parallel_size, where it gives one, must equal."""
    if mpu is None:
        return typed
    from zerokit.deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_degree_of
    degree = sequence_degree_of(mpu, model)
    if typed.sequence_parallel_size not in (1, degree):
        raise ValueError(f"the config's sequence_parallel_size={typed.sequence_parallel_size} but the mpu was "
                         f"registered with sequence_parallel_size={degree}: give the same")
    return replace(typed, sequence_parallel_size=degree)


def _refuse_sequence_ranks_in_pipeline_module(degree: int) -> None:
    """A PipelineModule's layers pass their activations alone between stages, with no position ids for a split
    sequence, its loss_fn sees one rank's shard, and its grid knows no sequence ranks: zerokit's own pipeline
    composes the two (See docs/pipeline.md)."""
    if degree > 1:
        raise ValueError(f"sequence_parallel_size={degree} with a DeepSpeed PipelineModule is not offered by zerokit "
                         "(its stages pass no position ids and its loss_fn sees one rank's shard); accepted: "
                         "sequence_parallel_size 1 with PipelineModule, or zerokit.pipeline.initialize with "
                         "Layout.resolve(world_size, pipeline=p, sequence=s) (docs/pipeline.md)")


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None, param_init: ParamInit | None = None,
               ) -> tuple[DeepSpeedEngine, Any, torch.utils.data.DataLoader | None, Any]:
    """DeepSpeed's initialize on zerokit: returns (engine, optimizer, training_dataloader, lr_scheduler).
    `param_init` (zerokit's own): how a model built under zero.Init is initialised (See zerokit.deepspeed.zero)."""
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mesh_param is not None:
        raise ValueError("deepspeed.initialize(mesh_param=) asks for a device mesh zerokit does not take: give the "
                         "config's sequence_parallel_size or tensor_parallel block")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    source = deepspeed_defaults(recorded_tensor_parallel(config_source(args, config, config_params)))
    typed = with_sequence_of(load_config(source), mpu, model)
    check_local_rank(args)
    if optimizer is not None and typed.optimizer is not None:
        raise both_given_error("optimizer")
    if lr_scheduler is not None and typed.scheduler is not None:
        raise both_given_error("scheduler")
    if model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator is read once; the optimizer may need it again
    if optimizer is not None and not isinstance(optimizer, (torch.optim.Optimizer, list, tuple)):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    if _is_pipeline_module(model):  # DeepSpeed returns its PipelineEngine for one (See zerokit/deepspeed/pipe.py)
        from zerokit.deepspeed.pipe_engine import PipelineEngine
        if lr_scheduler is not None:
            raise ValueError("deepspeed.initialize(model=PipelineModule, lr_scheduler=) is not offered by zerokit: use "
                             "the config's scheduler block")
        _refuse_sequence_ranks_in_pipeline_module(typed.sequence_parallel_size)
        given = config_dict(source)  # the dict, so that stage 2 reduces once a step unless it says otherwise
        pipeline = PipelineEngine(model, optimizer, given or typed, model_parameters=model_parameters,
                                  training_data=training_data, collate_fn=collate_fn)
        return pipeline, pipeline.optimizer, pipeline.training_dataloader, pipeline.engine.lr_scheduler
    engine = DeepSpeedEngine(model, optimizer, typed, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                             collate_fn=collate_fn, param_init=param_init, given_config=config_dict(source))
    if mpu is not None:
        from zerokit.deepspeed.runtime.sequence_parallel.ulysses_sp import after_initialize
        after_initialize(engine.module)
    if engine.experts is not None:  # MoE layers split over ranks: deepspeed.utils.groups answers for their groups
        from zerokit.deepspeed.utils.groups import record_expert_groups
        record_expert_groups(engine.module, engine.experts.data.group)
    stream_trainer_saves()  # the HF Trainer's save_model, streamed at stage 3 (See zerokit/integrations/hf_trainer.py)
    if training_data is not None:
        engine.training_dataloader = engine.deepspeed_io(training_data)
    if typed.resume.load_dir is not None:  # with the loader's position (See zerokit/checkpoint/newest.py)
        resume_from_newest(engine, layout_directory(typed.resume.load_dir, engine.layout))
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


__all__ = ["initialize", "add_config_arguments", "config_source", "check_local_rank", "deepspeed_defaults"]
