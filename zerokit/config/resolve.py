"""The run's settings from the config and the facts (See [Note: each room gets its part] in settings.py):
`resolve(config, facts)` fills in what the config left to the run (ZeroConfig.resolve) and makes, once, the engine-wide
decisions (settings.decide, the planner's too) and one part per room; `parts_before_facts` the two parts the facts come
from (the mesh's and the engine group's). The engine calls these; no room below it names the whole config.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import torch

from zerokit.config.settings import (CheckpointSettings, CommSettings, EngineChoices, EngineSettings, Facts,
                                     ObserveSettings, OffloadSettings, RunSettings, SafeguardSettings, StageSettings,
                                     StepSettings, TensorSettings, decide, flattened, launcher_ranks_per_node)
from zerokit.config.typed import DTYPE_NAMES, ZeroConfig


def engine_choices(config: ZeroConfig) -> EngineChoices:
    """What this config chooses of the engine-wide decisions, in plain values (the planner makes its own)."""
    return EngineChoices(stage=config.stage, reduce_scatter=config.reduce_scatter,
                         reduce_every_micro_step=config.reduce_every_micro_step,
                         bucket_bytes=config.reduce_bucket_bytes,
                         reduce_dtype=DTYPE_NAMES[config.precision.reduce_dtype],
                         mics_shard_size=config.mics_shard_size, hpz_partition_size=config.hpz_partition_size,
                         ranks_per_node=config.ranks_per_node)


def engine_settings(config: ZeroConfig, world_size: int, backend: str,
                    launcher_per_node: int | None = None) -> EngineSettings:
    """What an engine with this (resolved) config does on these ranks and back-end (See [Note: one place for each engine
    decision] in settings.py), for a caller without the run's facts: `launcher_per_node` (None: the launcher's, read
    here, as the engine reads it into its facts)."""
    launcher = launcher_per_node or launcher_ranks_per_node()
    return decide(engine_choices(config), Facts(world_size=world_size, backend=backend, ranks_per_node=launcher))


def parts_before_facts(config: ZeroConfig, launcher_per_node: int | None) -> tuple[TensorSettings, CommSettings]:
    """The parts the run's facts come from, made before them: parallel/tensor/'s, for the mesh (the data group is one of
    its dimensions), with the launcher's ranks per node (a fact known before), and comm/'s, for the engine's group
    (its size and back-end are facts). No "auto" reaches them: resolve hands out the same."""
    return (TensorSettings(autotp_size=config.autotp_size, sequence_parallel_size=config.sequence_parallel_size,
                           expert_parallel_size=config.expert_parallel_size,
                           ranks_per_node=config.ranks_per_node,
                           launcher_ranks_per_node=launcher_per_node, timeout_seconds=config.comm_timeout_seconds),
            CommSettings(timeout_seconds=config.comm_timeout_seconds, logger=config.comms_logger))


def resolve(config: ZeroConfig, facts: Facts) -> tuple[ZeroConfig, RunSettings]:
    """The config with every "auto" filled in for these facts (ZeroConfig.resolve), and the run's settings made from it
    once: the engine-wide decisions (the planner's `decide` too) and one part per room."""
    config = config.resolve(world_size=facts.batch_ranks or facts.world_size, hidden_size=facts.hidden_size)
    decisions = decide(engine_choices(config), facts)
    # the tiers check that every rank of a node fits in its host memory and NVMe: the same nodes as the decisions'
    offload = OffloadSettings(optimizer=config.offload_optimizer, param=config.offload_param,
                              sub_group_size=config.sub_group_size, ranks_per_node=decisions.ranks_per_node,
                              param_dtype=config.precision.param_dtype)
    # torchrun's node to check consecutive numbering against, where the nodes are the launcher's
    node_rank = facts.node_rank if decisions.ranks_per_node == facts.ranks_per_node else None
    return config, RunSettings(
        decisions=decisions, stage=_stage_settings(config, offload), offload=offload,
        step=StepSettings(gradient_accumulation_steps=config.gradient_accumulation_steps,
                          gradient_clipping=config.gradient_clipping,
                          max_consecutive_skipped_steps=config.max_consecutive_skipped_steps,
                          loss_scaling=config.loss_scaling),
        tensor=(early := parts_before_facts(config, facts.ranks_per_node))[0], comm=early[1],
        checkpoint=_checkpoint_settings(config), observe=_observe_settings(config),
        safeguards=_safeguard_settings(config, decisions.ranks_per_node, node_rank),
        activations=config.activation_checkpointing, preemption=config.preemption,
        startup_lines=tuple(config.startup_log_lines()), warnings=config.warnings)


def _stage_settings(config: ZeroConfig, offload: OffloadSettings) -> StageSettings:
    return StageSettings(stage=config.stage, param_dtype=config.precision.param_dtype,
                         reduce_dtype=config.precision.reduce_dtype, sub_group_size=config.sub_group_size,
                         units=config.stage3, checkpoint_units=config.activation_checkpointing.checkpoint_units,
                         overlaps_reduction=config.overlaps_reduction, prescale_gradients=config.prescale_gradients,
                         gradient_predivide_factor=config.gradient_predivide_factor, offload=offload)


def _checkpoint_settings(config: ZeroConfig) -> CheckpointSettings:
    return CheckpointSettings(stage=config.stage, param_dtype=config.precision.param_dtype,
                              gradient_accumulation_steps=config.gradient_accumulation_steps,
                              optimizer_kinds=config.optimizer_kinds,
                              allow_untested_optimizer=config.allow_untested_optimizer,
                              tag_validation=config.tag_validation, async_save=config.checkpoint_async_save,
                              record=plain_fields(config))


def _observe_settings(config: ZeroConfig) -> ObserveSettings:
    return ObserveSettings(steps_per_print=config.steps_per_print, wall_clock_breakdown=config.wall_clock_breakdown,
                           train_batch_size=config.train_batch_size, is_fp16=config.is_fp16,
                           comms_logger=config.comms_logger, flops_profiler=config.flops_profiler,
                           csv_monitor=config.csv_monitor, tensorboard=config.tensorboard, wandb=config.wandb)


def _safeguard_settings(config: ZeroConfig, per_node: int, node_rank: int | None) -> SafeguardSettings:
    return SafeguardSettings(stage=config.stage, units=config.stage3, ranks_per_node=per_node, node_rank=node_rank,
                             broadcast_buffers=config.broadcast_buffers,
                             gradient_accumulation_steps=config.gradient_accumulation_steps,
                             has_scheduler=config.scheduler is not None, agreed=tuple(flattened("config", config)))


def plain_fields(config: Any) -> dict[str, Any]:
    """The config's fields that are plain values (dtypes by torch's name, "float32"), nested dataclasses included: what
    a checkpoint's manifest records of it."""
    out: dict[str, Any] = {}
    for item in fields(config):
        value = getattr(config, item.name)
        if isinstance(value, torch.dtype):
            out[item.name] = str(value).removeprefix("torch.")
        elif is_dataclass(value) and not isinstance(value, type):
            out[item.name] = plain_fields(value)
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[item.name] = value
        elif isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str)) for v in value):
            out[item.name] = list(value)
    return out


__all__ = ["engine_choices", "engine_settings", "parts_before_facts", "resolve", "plain_fields"]
