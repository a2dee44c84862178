"""The engine's constants that the planner predicts from: one copy, importable without torch."""

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Gradients are reduced in buckets of about this many bytes (torch DDP's bucket_cap_mb=25)."""

MAX_BUCKETS_IN_FLIGHT = 2
"""The bucket reducer waits for the oldest reduction once this many are in flight; while the next one
launches, one more bucket is staged, so at most MAX_BUCKETS_IN_FLIGHT + 1 are held at once."""

CPU_OPTIMIZER_PIECE_NUMEL = 1 << 16
"""Elements per optimizer piece when the fp32 masters live in host memory (See [Note: optimizer pieces])."""

NVME_SUB_GROUP_NUMEL = 1 << 18
"""Elements per NVMe optimizer record when sub_group_size is not set (See [Note: paging a master through a
bounded pool]): AdamW's record and gradient area are then 4 MiB, a pool of 4 of them 16 MiB."""

STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000
"""Stage 3: parameters with fewer elements join the root unit (stage3_param_persistence_threshold's default)."""
