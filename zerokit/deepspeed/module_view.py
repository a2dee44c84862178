"""The model as DeepSpeed's engine shows it, an nn.Module holding it as `module`: its parameters and modules
(the Trainer counts parameters through the engine; accelerate's unwrap_model walks `_modules`), its full
weights for saving (what accelerate's get_state_dict and the Trainer's save_model read), and at stage 3 what
DeepSpeed's callers read off its parameters and optimizer (See zerokit/deepspeed/zero3_params.py)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from zerokit.deepspeed.zero3_params import answer_ds_status, give_back_class, offer_parameter_offload


class ModuleView:
    """Mixed into zerokit.deepspeed's engine, whose `module`, `config` and `full_state_dict()` these read."""

    module: nn.Module
    config: Any
    full_state_dict: Any  # the engine's (zerokit/engine/engine.py): the whole model's state dict, gathered
    optimizer: Any
    _answering_ds_status: list[nn.Parameter] = []  # parameters given the class ZeroParameter, until close()

    def show_zero3_names(self) -> None:
        """At stage 3: the parameters answer `ds_status`, the optimizer offers `parameter_offload` (See [Note:
        ds_status is read from the tensor] and [Note: the hooks TRL removes around generation])."""
        if self.config.stage != 3:
            return
        self._answering_ds_status = answer_ds_status(self.module)
        if self.optimizer is not None:
            offer_parameter_offload(self.optimizer)

    def close(self) -> None:
        """The engine's close(), and the parameters get back the class they had."""
        give_back_class(self._answering_ds_status)
        self._answering_ds_status = []
        super().close()  # type: ignore[misc]

    def parameters(self, recurse: bool = True) -> Iterable[nn.Parameter]:
        """The model's parameters (the Trainer counts them through the engine)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterable[tuple[str, nn.Parameter]]:
        """The model's parameters named as DeepSpeed's engine names them: under `module.`."""
        return self.module.named_parameters(prefix + ("." if prefix else "") + "module", recurse, remove_duplicate)

    @property
    def _modules(self) -> dict[str, nn.Module]:
        """nn.Module's table of children: the model, as `module` (accelerate's unwrap_model walks it)."""
        return {"module": self.module}

    def modules(self) -> Iterator[Any]:
        """The engine, then the model's modules, in nn.Module's order."""
        yield self
        yield from self.module.modules()

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether saving the model gathers its full weights: always, at every stage (engine.full_state_dict()
        gathers one unit at a time), so stage3_gather_16bit_weights_on_model_save needs no setting."""
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state dict at the compute precision, on every rank (DeepSpeed fills it on rank 0;
        callers save it there). What accelerate's get_state_dict and the Trainer's save_model read."""
        dtype = self.config.precision.param_dtype
        state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                 for name, tensor in self.full_state_dict().items()}
        if exclude_frozen_parameters:
            frozen = {name for name, param in self.module.named_parameters() if not param.requires_grad}
            state = {name: tensor for name, tensor in state.items() if name not in frozen}
        return state


__all__ = ["ModuleView"]
