"""The questions DeepSpeed's engine answers from its config and counters (train_batch_size(), fp16_enabled(),
global_steps, ...), which trainers ask of the drop-in engine."""

from __future__ import annotations

from typing import Any

import torch


class ConfigQueries:
    """Mixed into zerokit.deepspeed's engine, whose `config` and `progress` these read."""

    config: Any  # the engine's config (zerokit/deepspeed/config_view.py EngineConfig over ZeroConfig)
    progress: Any  # zerokit/engine/step.py Progress

    @property
    def global_steps(self) -> int:
        return self.progress.optimizer_step + self.progress.total_skips

    @property
    def global_samples(self) -> int:
        return self.global_steps * self.train_batch_size()

    @property
    def skipped_steps(self) -> int:
        return self.progress.total_skips

    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.stage

    def zero_optimization(self) -> bool:
        return self.config.stage > 0

    def fp16_enabled(self) -> bool:
        return self.config.precision.param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.param_dtype == torch.bfloat16

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last


__all__ = ["ConfigQueries"]
