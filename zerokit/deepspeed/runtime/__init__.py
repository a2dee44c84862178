"""`deepspeed.runtime` for zerokit: the modules frameworks import from it (engine, lr_schedules, zero,
base_optimizer, sequence_parallel)."""

# Imported with the package, as `import deepspeed` imports them: accelerate reads
# deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES with no import of its own.
from zerokit.deepspeed.runtime import base_optimizer, engine, lr_schedules, sequence_parallel, utils, zero

__all__ = ["base_optimizer", "engine", "lr_schedules", "sequence_parallel", "utils", "zero"]
