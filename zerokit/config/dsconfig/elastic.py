"""DeepSpeed's `elasticity` block: the global batch, micro-batch and accumulation for the world size a job starts
at, chosen as DeepSpeed's `compute_elastic_config` chose them, so that a job restarted on more or fewer ranks keeps
its global batch.

[Note: elastic batch sizes]
DeepSpeed (up to 0.18; 0.19.8 removed the block and refuses it) let a config give bounds instead of batch sizes:
the largest global batch acceptable (`max_train_batch_size`), the micro-batches a rank may run
(`micro_batch_sizes`), and a range of GPU counts. From those alone, never from the world size (version 0.1), or from
the world size too where it is not one of the counts chosen for (version 0.2), it picks one global batch that as
many GPU counts as possible can split exactly: candidates are each micro-batch and their least common multiple,
each scaled by the largest highly composite number that keeps it within the maximum; the candidate with the most
GPU counts in range that split it (micro-batch x accumulation x GPUs) wins, ties going to the larger batch
(`prefer_larger_batch`, else the smaller). At a world size the global batch is split with the largest micro-batch
that divides the batch per rank, and accumulation makes up the rest. A world size the batch cannot be split over
is refused (version 0.1), or given a batch of its own (version 0.2: the largest multiple of micro-batch x world
size within the maximum), which then changes the global batch: the point of the block is to pick `min_gpus` and
`max_gpus` so that every size the job may run at is among the valid ones.

zerokit reproduces DeepSpeed 0.18.0's deepspeed/elasticity/elasticity.py here, function for function, and
tests/test_elastic.py compares it with that code's results over a grid of configs and world sizes (the fixture
tests/fixtures/elasticity/deepspeed_0.18.0.json, written by the generator beside it). Where DeepSpeed's code
crashes (no valid GPU count at all, an `assert`), this raises ValueError saying why. zerokit is data parallel only,
so `model_parallel_size` other than 1 is refused; `num_gpus_per_node` is honoured as version 0.2 reads it;
`min_time` is read and checked, for the scheduler. As in DeepSpeed, batch keys given beside an enabled block are
an error unless `ignore_non_elastic_batch_info` is true, and then they are overridden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HIGHLY_COMPOSITE = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
                    10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200,
                    332640, 498960, 554400, 665280, 720720)
"""DeepSpeed's HCN_LIST: the 38 smallest highly composite numbers (enough for batches up to 720K)."""
LATEST_VERSION = 0.2
BLOCK_KEYS = ("enabled", "max_train_batch_size", "micro_batch_sizes", "min_gpus", "max_gpus", "min_time", "version",
              "prefer_larger_batch", "ignore_non_elastic_batch_info", "num_gpus_per_node", "model_parallel_size")


@dataclass(frozen=True)
class ElasticPolicy:
    """The `elasticity` block, read and checked as DeepSpeed's ElasticityConfig reads it (its defaults)."""

    max_train_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    min_gpus: int = 1
    max_gpus: int = 10000
    min_time: int = 0  # minutes the scheduler should let a size run before scaling (read for it, unused here)
    version: float = LATEST_VERSION
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    num_gpus_per_node: int = 1

    @classmethod
    def from_block(cls, block: dict[str, Any]) -> "ElasticPolicy":
        """From an enabled block (keys as DeepSpeed spells them); ValueError naming the key on a bad value."""
        for key in ("max_train_batch_size", "micro_batch_sizes"):
            if key not in block:
                raise ValueError(f"elasticity.{key} is required when elasticity is enabled (as DeepSpeed requires)")
        micro = block["micro_batch_sizes"]
        if not isinstance(micro, (list, tuple)) or not micro or not all(isinstance(m, int) and m > 0 for m in micro):
            raise ValueError(f"elasticity.micro_batch_sizes={micro!r}: expected a list of positive integers")
        if block.get("model_parallel_size", 1) != 1:
            raise ValueError(f"elasticity.model_parallel_size={block['model_parallel_size']!r}: zerokit is data "
                             "parallel only (1); combine it with torch's own tensor or pipeline parallelism")
        policy = cls(int(block["max_train_batch_size"]), tuple(micro),
                     **{key: block[key] for key in ("min_gpus", "max_gpus", "min_time", "version",
                                                    "prefer_larger_batch", "ignore_non_elastic_batch_info",
                                                    "num_gpus_per_node") if key in block})
        policy.check()
        return policy

    def check(self) -> None:
        if self.min_gpus < 1 or self.max_gpus < 1 or self.max_gpus < self.min_gpus:
            raise ValueError(f"elasticity.min_gpus={self.min_gpus}, max_gpus={self.max_gpus}: both must be >= 1 "
                             "and min_gpus <= max_gpus")
        if self.num_gpus_per_node < 1 or self.min_time < 0:
            raise ValueError(f"elasticity.num_gpus_per_node={self.num_gpus_per_node} must be >= 1 and "
                             f"min_time={self.min_time} >= 0")
        if float(self.version) not in (0.1, 0.2):
            raise ValueError(f"elasticity.version={self.version}: DeepSpeed's elastic logic has versions 0.1 and "
                             f"0.2 ({LATEST_VERSION}, the default)")


@dataclass(frozen=True)
class ElasticBatch:
    """What the block chooses at one world size."""

    train_batch_size: int
    micro_batch: int
    accumulation: int
    valid_world_sizes: tuple[int, ...]  # the GPU counts the global batch splits over exactly


def elastic_batch(policy: ElasticPolicy, world_size: int) -> ElasticBatch:
    """DeepSpeed's compute_elastic_config(config, version, world_size) and the accumulation its runtime derives
    from it (See [Note: elastic batch sizes])."""
    micro = list(policy.micro_batch_sizes)
    if float(policy.version) == 0.1:
        total, valid = compatible_v01(micro, policy.max_train_batch_size, policy.min_gpus, policy.max_gpus,
                                      policy.prefer_larger_batch)
    else:
        total, valid = compatible_v02(micro, policy.max_train_batch_size, world_size, policy.min_gpus,
                                      policy.max_gpus, policy.prefer_larger_batch, policy.num_gpus_per_node)
    total = int(total)
    if world_size not in valid:
        raise ValueError(f"world size {world_size} is not one the elastic global batch {total} splits over: valid "
                         f"sizes {valid} (elasticity.min_gpus/max_gpus and micro_batch_sizes choose them)")
    chosen = next((size for size in sorted(set(micro), reverse=True) if total // world_size % size == 0), None)
    if chosen is None:
        raise ValueError(f"no micro-batch of {micro} divides the elastic batch per rank {total} // {world_size}")
    return ElasticBatch(total, chosen, total // (chosen * world_size), tuple(valid))


def candidate_batch_sizes(bases: list[int], max_batch: int) -> list[int]:
    """Each base scaled by the largest highly composite number that keeps it within `max_batch` (DeepSpeed: the
    next one down from the first above max_batch // base; past the list, its last)."""
    candidates = set()
    for base in bases:
        if base >= max_batch:
            candidates.add(base)
            continue
        quotient = max_batch // base
        above = next((index for index, hcn in enumerate(HIGHLY_COMPOSITE) if hcn > quotient), 0)
        candidates.add(HIGHLY_COMPOSITE[above - 1] * base)
    return sorted(candidates)


def valid_gpu_counts(batch: int, micro: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    """The GPU counts in [min_gpus, max_gpus] over which `batch` splits as micro-batch x accumulation x GPUs, as
    DeepSpeed's get_valid_gpus counts them (for each micro-batch: batch // micro, and its divisors up to half)."""
    valid = set()
    for size in micro:
        if batch % size:
            continue
        most = batch // size
        if min_gpus <= most <= max_gpus:
            valid.add(most)
        for count in range(max(1, min_gpus), min(most // 2, max_gpus) + 1):
            if most % count == 0:
                valid.add(count)
    return sorted(valid)


def best_candidate(candidates: list[int], micro: list[int], min_gpus: int, max_gpus: int,
                   prefer_larger: bool) -> tuple[int, list[int]]:
    """The candidate valid over the most GPU counts; ties to the larger (or smaller) batch. DeepSpeed starts from
    the smallest micro-batch with no count, so a candidate valid nowhere wins only by its size."""
    best_count, best, chosen = 0, min(micro), None
    for batch in candidates:
        valid = valid_gpu_counts(batch, micro, min_gpus, max_gpus)
        better = batch > best if prefer_larger else batch < best
        if len(valid) > best_count or (len(valid) == best_count and better):
            best_count, best, chosen = len(valid), batch, valid
    if chosen is None:
        raise ValueError(f"no global batch within the maximum splits over any GPU count in [{min_gpus}, {max_gpus}] "
                         f"with micro-batches {micro}")
    return best, chosen


def compatible_v01(micro: list[int], max_batch: int, min_gpus: int | None, max_gpus: int | None,
                   prefer_larger: bool) -> tuple[int, list[int]]:
    """Version 0.1: the global batch and its valid GPU counts, from the bounds alone."""
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_batch // min(micro)
    if any(size > max_batch for size in micro):
        raise ValueError(f"elasticity.micro_batch_sizes {micro} must all be <= max_train_batch_size {max_batch}")
    return best_candidate(candidate_batch_sizes([*micro, math.lcm(*micro)], max_batch), micro, min_gpus, max_gpus,
                          prefer_larger)


def compatible_v02(micro: list[int], max_batch: int, world_size: int, min_gpus: int, max_gpus: int,
                   prefer_larger: bool, gpus_per_node: int) -> tuple[float, list[int]]:
    """Version 0.2: version 0.1 over nodes; a world size outside the valid counts gets a batch of its own."""
    per_node = gpus_per_node  # data-parallel ranks per node (model_parallel_size is 1)
    total, valid = compatible_v01(micro, int(max_batch / per_node), int(min_gpus / gpus_per_node),
                                  int(max_gpus / gpus_per_node), prefer_larger)
    valid = [count * per_node for count in valid]
    if world_size in valid:
        return int(total) * per_node, valid
    ranks = (world_size / gpus_per_node) * per_node
    own = [math.floor(max_batch / float(size * ranks)) * size * ranks for size in micro]
    return (max(own) if prefer_larger else min(own)), [int(ranks)]


__all__ = ["BLOCK_KEYS", "ElasticBatch", "ElasticPolicy", "candidate_batch_sizes", "elastic_batch"]
