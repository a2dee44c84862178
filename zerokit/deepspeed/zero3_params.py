"""What DeepSpeed's callers read off a ZeRO-3 model besides the engine's methods: a parameter's `ds_status`, and the
engine optimizer's `parameter_offload` (whose hooks Hugging Face TRL removes around generation).

[Note: ds_status is read from the tensor]
TRL's fused LM head (trl/trainer/utils.py maybe_gather_lm_head_ctx, in DPO's and GRPO's forward and in its
backward) reads `param.ds_status` of the output embedding under ZeRO-3 and gathers the weight with
GatheredParameters unless it is ZeroParamStatus.AVAILABLE. DeepSpeed attaches ds_* attributes to every parameter
and keeps them current as it gathers and partitions. zerokit attaches nothing to a parameter: the answer is in
the tensor itself, since a released stage-3 parameter is a one-element placeholder broadcast to its shape (See
flat/buffers.py release) and a gathered one is a view of its unit's full buffer. So the drop-in's stage-3 engine
gives its model's parameters the class ZeroParameter, nn.Parameter with a read-only `ds_status` property that
looks at the parameter's storage; no state is added to the parameter, isinstance(p, nn.Parameter) holds,
state_dict() returns plain tensors, and engine.close() gives the parameters their class back. (torch changes a
parameter's class in place the same way: nn.UninitializedParameter becomes nn.Parameter when materialised.) A
one-element parameter's placeholder has the size of its values, so it reads as AVAILABLE only as a view of a
larger buffer, which a released one never is.

[Note: the hooks TRL removes around generation]
TRL's unwrap_model_for_generation gathers every parameter with GatheredParameters, then calls remove_hooks(engine)
and, after generate(), add_hooks(engine) (trl/models/utils.py): it clears DeepSpeed's forward and backward hooks
off `engine.optimizer.parameter_offload` so that they do not partition parameters during generation, and
re-registers them after. zerokit's hooks already leave every unit gathered while GatheredParameters holds them
(the stage-3 state PINNED: See [Note: the stage-3 step] in stages/hooks.py), so there is nothing to remove:
ParameterOffloadView answers TRL's calls with no hooks to remove and nothing to register, and its `module`
reports no parameter for TRL to reset DeepSpeed's per-parameter bookkeeping on. It is set on the optimizer the
engine rebuilt (zerokit's own object, never the user's) only at stage 3, as DeepSpeed's exists only there.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterator

import torch
from torch import nn


class ZeroParamStatus(Enum):
    """DeepSpeed's names for where a ZeRO-3 parameter's values are (deepspeed.runtime.zero.partition_parameters)."""
    AVAILABLE = 1  # full values on this rank
    NOT_AVAILABLE = 2  # partitioned: this rank holds its shard only
    INFLIGHT = 3  # being gathered (zerokit reports a gather in flight as NOT_AVAILABLE until it is waited for)


def is_whole(param: torch.Tensor) -> bool:
    """The parameter holds its full values: its storage has room for them (a released one is a one-element
    placeholder broadcast to its shape). A one-element parameter must be a view of a larger buffer (its unit's, or
    stages 0-2's flat buffer): alone in one element's storage it cannot be told from a placeholder. See [Note:
    ds_status is read from the tensor]."""
    held, own = param.untyped_storage().nbytes(), param.numel() * param.element_size()
    return held >= own and (param.numel() > 1 or held > own)


class ZeroParameter(nn.Parameter):
    """nn.Parameter answering DeepSpeed's `ds_status` (See [Note: ds_status is read from the tensor])."""

    @property
    def ds_status(self) -> ZeroParamStatus:
        return ZeroParamStatus.AVAILABLE if is_whole(self) else ZeroParamStatus.NOT_AVAILABLE


def answer_ds_status(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of `model` of the exact class nn.Parameter becomes a ZeroParameter; returns those changed,
    for give_back_class()."""
    changed = [param for param in model.parameters() if type(param) is nn.Parameter]
    for param in changed:
        param.__class__ = ZeroParameter
    return changed


def give_back_class(params: list[nn.Parameter]) -> None:
    for param in params:
        if type(param) is ZeroParameter:
            param.__class__ = nn.Parameter


class _NoParameters:
    """The module as TRL's remove_hooks walks it: no parameter carries DeepSpeed's bookkeeping to reset."""

    def named_parameters(self, recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(())

    def ds_external_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return []


class ParameterOffloadView:
    """DeepSpeed's DeepSpeedZeRoOffload as TRL's remove_hooks / add_hooks use it (See [Note: the hooks TRL removes
    around generation])."""

    def __init__(self) -> None:
        self.module = _NoParameters()
        self.forward_hooks: list[Any] = []
        self.backward_hooks: list[Any] = []

    def _register_deepspeed_module(self, module: Any) -> None:
        """zerokit's hooks stay on the model throughout: nothing to register again."""


def offer_parameter_offload(optimizer: Any) -> None:
    """The engine's rebuilt optimizer(s) get the `parameter_offload` TRL looks for."""
    for each in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        if isinstance(each, torch.optim.Optimizer):
            each.parameter_offload = ParameterOffloadView()


__all__ = ["ZeroParamStatus", "ZeroParameter", "is_whole", "answer_ds_status", "give_back_class",
           "ParameterOffloadView", "offer_parameter_offload"]
