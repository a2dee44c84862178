"""`deepspeed.ops.adagrad` for zerokit: DeepSpeedCPUAdagrad as the torch optimizer it computes (torch's Adagrad,
DeepSpeed's defaults). zerokit steps any torch optimizer on the fp32 master shards, offloaded or not; accelerate
maps a torch Adagrad to this class when the optimizer is offloaded."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def DeepSpeedCPUAdagrad(model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,  # noqa: N802
                        weight_decay: float = 0.0, amsgrad: bool = False,
                        fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    if amsgrad:
        raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True) is not offered: Adagrad has no amsgrad variant (DeepSpeed "
                         "refuses it too)")
    return torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPUAdagrad"]
