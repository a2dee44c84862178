"""`deepspeed.runtime` for zerokit: the modules frameworks import from it (engine, lr_schedules, zero,
base_optimizer). Sequence parallelism (runtime.sequence_parallel) is not offered."""
