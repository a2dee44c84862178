"""`deepspeed.ops` for zerokit: the optimizers scripts import from it (ops.adam), as torch optimizers."""

from zerokit.deepspeed.ops import adagrad, adam, lion  # imported with the package, as DeepSpeed's ops are

__all__ = ["adagrad", "adam", "lion"]
