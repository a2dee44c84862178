"""What checkpoints read and write of an engine (zerokit/engine/engine.py's Engine, or the drop-in's): its counters,
its schedules and its per-parameter view, never its stage (See [Note: a per-parameter view of the stage] in
stages/view.py)."""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from zerokit.checkpoint.data_position import DataPosition
from zerokit.config.settings import RunSettings
from zerokit.stages.view import ParameterView


class SavedProgress(Protocol):
    """What checkpoints read and write of where training stands (zerokit/engine/step.py's Progress, a dataclass: saved
    with dataclasses.asdict, restored with dataclasses.replace). Named by its shape, not imported: the engine's step
    sits above the checkpoints, and a type is named only downward."""

    micro_step: int
    optimizer_step: int
    total_skips: int
    backward_since_step: bool

    @property
    def inside_window(self) -> bool: ...

    def without_window(self) -> SavedProgress: ...


class Checkpointed(Protocol):
    rank: int
    world_size: int
    module: nn.Module
    parts: RunSettings  # the run's settings (config/settings.py); checkpoints read their part, `parts.checkpoint`
    view: ParameterView
    progress: SavedProgress
    loss_scaler: Any  # precision/scaler.py's DynamicLossScaler or NoLossScaler: state_dict() and load_state_dict()
    lr_schedules: list[Any]  # the LR schedules the engine steps: state_dict() and load_state_dict()
    data_position: DataPosition  # the loader or sampler whose position checkpoints save
    layout: Any  # zerokit.Layout of the job (None: flat data parallel), See relayout.py
    tensor: Any  # parallel/tensor/share.py's TensorShare (None: no tensor parallelism): its `split` parameters
    tied_names: frozenset[str]  # parameters tied to copies on other pipeline stages


__all__ = ["Checkpointed", "SavedProgress"]
