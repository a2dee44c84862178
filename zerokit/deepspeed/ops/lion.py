"""`deepspeed.ops.lion` for zerokit: importable (accelerate imports it when it maps a bitsandbytes Lion to
DeepSpeed's CPU Lion), and refused in one line when called, as the config's `"Lion"` optimizer is: torch has no
Lion, and zerokit steps whatever torch optimizer it is given, so pass a Lion optimizer object to initialize()."""

from __future__ import annotations

from typing import Any

REFUSAL = ("deepspeed.ops.lion.{} is not offered by zerokit: it is DeepSpeed's Lion kernel; pass a Lion written as a "
           "torch.optim.Optimizer to initialize() instead (zerokit steps any torch optimizer, offloaded or not)")


def DeepSpeedCPULion(*args: Any, **kwargs: Any) -> Any:  # noqa: N802
    raise ValueError(REFUSAL.format("DeepSpeedCPULion"))


def FusedLion(*args: Any, **kwargs: Any) -> Any:  # noqa: N802
    raise ValueError(REFUSAL.format("FusedLion"))


__all__ = ["DeepSpeedCPULion", "FusedLion"]
