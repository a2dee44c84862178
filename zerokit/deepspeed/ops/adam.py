"""`deepspeed.ops.adam` for zerokit: FusedAdam and DeepSpeedCPUAdam as the torch optimizers they compute.

DeepSpeed's fused CUDA kernel and its CPU Adam compute torch's Adam (adam_w_mode / adamw_mode true: AdamW's
decoupled weight decay), so these return torch.optim.AdamW or torch.optim.Adam with the same hyperparameters
and DeepSpeed's defaults (weight decay 0). zerokit steps whatever torch optimizer it is given on the fp32 master
shards, offloaded or not, so no special CPU optimizer is needed.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def _adam(params: Iterable[Any], lr: float, bias_correction: bool, betas: tuple[float, float], eps: float,
          weight_decay: float, amsgrad: bool, decoupled: bool, name: str) -> torch.optim.Optimizer:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not offered: torch's Adam always corrects bias")
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def FusedAdam(params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
              weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> torch.optim.Optimizer:
    return _adam(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, "FusedAdam")


def DeepSpeedCPUAdam(model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                     amsgrad: bool = False, adamw_mode: bool = True,
                     fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    return _adam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode, "DeepSpeedCPUAdam")


__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
