"""What checkpoints read and write of an engine (zerokit/engine.py's Engine, or the drop-in's): its counters,
its schedules and its per-parameter view, never its stage (See [Note: a per-parameter view of the stage] in
stages/view.py)."""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from zerokit.checkpoint.data_position import DataPosition
from zerokit.config import ZeroConfig
from zerokit.stages.view import ParameterView
from zerokit.step import Progress


class Checkpointed(Protocol):
    rank: int
    world_size: int
    module: nn.Module
    config: ZeroConfig
    view: ParameterView
    progress: Progress
    loss_scaler: Any  # precision.py's DynamicLossScaler or NoLossScaler: state_dict() and load_state_dict()
    lr_schedules: list[Any]  # the LR schedules the engine steps: state_dict() and load_state_dict()
    data_position: DataPosition  # the loader or sampler whose position checkpoints save
    layout: Any  # zerokit.Layout of the job (None: flat data parallel), See relayout.py
    tensor: Any  # tensor/share.py's TensorShare (None: no tensor parallelism): its `split` parameters
    tied_names: frozenset[str]  # parameters tied to copies on other pipeline stages


__all__ = ["Checkpointed"]
