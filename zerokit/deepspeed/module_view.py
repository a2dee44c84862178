"""The model as DeepSpeed's engine shows it, an nn.Module holding it as `module`: its parameters and modules
(the Trainer counts parameters through the engine; accelerate's unwrap_model walks `_modules`), its full
weights for saving (what accelerate's get_state_dict and the Trainer's save_model read), and at stage 3 what
DeepSpeed's callers read off its parameters and optimizer (See zerokit/deepspeed/zero3_params.py).

[Note: the whole state dict at the compute precision]
accelerate's get_state_dict(engine) under a ZeRO-3 config calls engine._zero3_consolidated_16bit_state_dict() on
every rank and hands the dict to its caller, who saves it on one rank with a writer that needs every tensor in memory
(transformers' save_pretrained, torch.save). The gathers need every rank, so they are over when it returns. What the
drop-in does: the dict is gathered one unit at a time straight into the compute dtype, with no fp32 copy of the model
beside it, a tie's names sharing one tensor as DeepSpeed's do, so the peak is the model once at the compute
precision, as under DeepSpeed (which fills it on rank 0 only; zerokit's callers have read it on every rank). The
Trainer's save_model does not come here at stage 3: it streams (See [Note: the Trainer's save_model streams] in
zerokit/integrations/hf_trainer.py), and so does engine.save_pretrained(output_dir) called on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
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
    view: Any  # the engine's ParameterView (See zerokit/stages/view.py)
    tensor: Any  # the engine's tensor-parallel share (None without tensor parallelism)
    rank: int
    _refuse_if_closed: Any
    checkpointed: Any  # the engine as checkpoints see it (the unsplit model's names where experts are split)
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
        callers save it there), a tie's names sharing one tensor as in DeepSpeed's (transformers' save_pretrained
        then writes it once). Gathered one unit at a time straight into the compute dtype: no fp32 copy of the
        model. What accelerate's get_state_dict reads (See [Note: the whole state dict at the compute precision])."""
        from zerokit.checkpoint.pretrained import gathered_state_dict  # safetensors, imported on first save

        if self.tensor is None:  # split experts: the unsplit model's (See [Note: split experts gathered whole])
            saved = self.checkpointed()
            return gathered_state_dict(saved.view, saved.module, None, exclude_frozen_parameters, keep=True)
        dtype = self.config.precision.param_dtype  # tensor-parallel: whole tensors come from full_state_dict()
        state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                 for name, tensor in self.full_state_dict().items()}
        if exclude_frozen_parameters:
            frozen = {name for name, param in self.module.named_parameters() if not param.requires_grad}
            state = {name: tensor for name, tensor in state.items() if name not in frozen}
        return state

    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: rank 0 writes one file of the model's weights at the compute precision (every rank calls
        it: at stage 3 the weights are gathered). A name ending in .safetensors is written as safetensors, streamed
        one unit at a time as engine.save_pretrained writes (tied weights once); any other with torch.save, as
        DeepSpeed writes it (a tie's names sharing one tensor), of a state dict gathered one unit at a time in the
        compute dtype and held on rank 0 only: torch.save needs the whole dict. Returns True (saved)."""
        from zerokit.checkpoint.pretrained import gathered_state_dict, save_weights_file

        self._refuse_if_closed("save_16bit_model")
        path, saved = Path(save_dir) / save_filename, self.checkpointed()  # split experts: the unsplit model's
        if path.suffix == ".safetensors":
            save_weights_file(saved, path, None, exclude_frozen_parameters)
            return True
        state = gathered_state_dict(saved.view, saved.module, None, exclude_frozen_parameters, keep=self.rank == 0)
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(path.name + ".tmp")
            torch.save(state, temporary)
            os.replace(temporary, path)
        return True


__all__ = ["ModuleView"]
