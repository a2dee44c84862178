"""`deepspeed.runtime` for zerokit: the modules frameworks import from it (engine, lr_schedules, zero,
base_optimizer). Sequence parallelism (runtime.sequence_parallel) is not offered."""

# Imported with the package, as `import deepspeed` imports them: accelerate reads
# deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES with no import of its own.
from zerokit.deepspeed.runtime import base_optimizer, engine, lr_schedules, utils, zero

__all__ = ["base_optimizer", "engine", "lr_schedules", "utils", "zero"]
