"""`deepspeed.runtime.lr_schedules` for zerokit: the names of DeepSpeed's schedules (accelerate hands a scheduler
whose class has one of these names to initialize(); zerokit builds these schedules from the config's
`scheduler` block: zerokit/engine/schedules.py)."""

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR"]
