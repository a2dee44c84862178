"""`zero_optimization` and its offload blocks (deepspeed/runtime/zero/config.py, offload_config.py)."""

from __future__ import annotations

import sys

from zerokit.config.dsconfig.keys import (Key, KeyClass, Kind, alias, always, block, honoured, refused, refused_block,
                                   zerokit_key)

Z = "zero_optimization."
ZERO_REMOVED_ISSUE = "deepspeedai/DeepSpeed#8489"
UNITS = "zerokit's units are named by stage3_unit_classes or found by stage3_min_unit_params"

CORE = (
    honoured(Z + "stage", Kind.INT, 0, "0: data parallel; 1: shard optimizer state; 2: and gradients; 3: and "
             "parameters", auto=False),
    honoured(Z + "reduce_bucket_size", Kind.INT, 500_000_000, "elements per gradient bucket (\"auto\": hidden^2); "
             "zerokit's default when absent is 25 MiB of reduce dtype"),
    always(Z + "allgather_bucket_size", "zerokit all-gathers each gradient bucket's updated parameters in place, "
           "into the flat parameter buffer: there is no staging buffer for this size to bound (a gather is "
           "reduce_bucket_size elements)", Kind.INT, 500_000_000),
    honoured(Z + "overlap_comm", Kind.BOOL, True, "reduce each bucket during backward as soon as it is full"),
    honoured(Z + "reduce_scatter", Kind.BOOL, None, "stages 1-3: reduce-scatter each bucket (true) or all-reduce "
             "it and keep this rank's shard (false); absent: true on NCCL, false on gloo"),
    honoured(Z + "sub_group_size", Kind.INT, None, "the optimizer steps fp32 masters in pieces of at most this "
             "many elements; 0: one piece per parameter, as DeepSpeed makes every parameter its own sub-group"),
    always(Z + "contiguous_gradients", "zerokit's gradient buckets are always contiguous (DeepSpeed's false only "
           "changes where it keeps gradients, never their values)", Kind.BOOL, True),
    always(Z + "allgather_partitions", "zerokit gathers updated parameters with one collective per bucket, picked "
           "per back-end (all-gather on NCCL, per-owner broadcasts on gloo); DeepSpeed's false, a series of "
           "broadcasts, gathers the same values", Kind.BOOL, True),
    always(Z + "round_robin_gradients", "a DeepSpeed offload copy-scheduling detail; zerokit moves each reduced "
           "shard once", Kind.BOOL, False),
    always(Z + "use_multi_rank_bucket_allreduce", "zerokit chooses reduce-scatter or all-reduce per bucket "
           "(reduce_scatter)", Kind.BOOL, True),
    always(Z + "compute_grad_norm", "zerokit computes the global norm in the scalar all-reduce that checks for "
           "overflow, so it costs nothing to keep", Kind.BOOL, True),
    always(Z + "load_from_fp32_weights", "zerokit builds fp32 masters from fp32 weights", Kind.BOOL, True, (True,),
           "false builds masters from the 16-bit copies, losing precision; zerokit never does"),
    always(Z + "ignore_unused_parameters", "zerokit finds parameters without a gradient and trains on", Kind.BOOL,
           True, (True,), "false stops training when a parameter gets no gradient; zerokit handles them"),
    always(Z + "memory_efficient_linear", "a DeepSpeed ZeRO-3 kernel; zerokit runs torch's own modules", Kind.BOOL,
           True),
    always(Z + "override_module_apply", "a DeepSpeed patch of nn.Module.apply; zerokit patches nothing", Kind.BOOL,
           True),
    always(Z + "log_trace_cache_warnings", "DeepSpeed trace-cache logging; zerokit has no trace cache", Kind.BOOL,
           False),
    always(Z + "enable_sanity_checks", "zerokit always runs its start-up checks", Kind.BOOL, False),
    always(Z + "save_muon_momentum_buffer_in_memory", "zerokit keeps Muon's momentum with the optimizer state",
           Kind.BOOL, False),
    always(Z + "elastic_checkpoint", "zerokit's checkpoints load on any world size and stage, which is what "
           "elastic checkpoints were for", Kind.BOOL, False),
    refused(Z + "legacy_stage1", "DeepSpeed's old stage-1 implementation", "zerokit has one stage 1 (DeepSpeed "
            "0.19.8 refuses it too)"),
    always(Z + "parameter_alignment", "zerokit packs parameters without alignment padding (padding moves "
           "addresses, not values)", Kind.BOOL, False),
    honoured(Z + "zero_hpz_partition_size", Kind.INT, 1, "stage 3: ZeRO++ hpZ, a secondary copy of the parameter "
             "shards over groups of this many consecutive ranks, read by every gather after a step's first", auto=False,
             stage3=True),
    refused(Z + "zero_quantized_weights", "ZeRO++ quantized weight all-gathers", "zerokit gathers in the compute "
            "dtype"),
    refused(Z + "zero_quantized_nontrainable_weights", "frozen weights stored quantized", "zerokit stores them in "
            "the compute dtype"),
    refused(Z + "zero_quantized_gradients", "ZeRO++ quantized gradient reduction", "zerokit reduces in "
            "communication_data_type"),
    always(Z + "pipeline_loading_checkpoint", "DeepSpeed 0.19.8 reads it nowhere; zerokit has no pipeline mode",
           Kind.BOOL, False),
    refused_block(Z + "zenflow", "ZenFlow's selective asynchronous CPU update", "zerokit steps every parameter "
                  "each step", switch=""),
    Key(Z + "leaf_module", KeyClass.ALWAYS, Kind.BLOCK, None, "zerokit gathers whole units, never a module's "
        "parameters one by one: name the classes to gather whole with stage3_unit_classes"),
)

STAGE3 = (
    honoured(Z + "stage3_max_live_parameters", Kind.INT, 1_000_000_000, "never hold more unsharded parameter "
             "elements at once", stage3=True),
    honoured(Z + "stage3_prefetch_bucket_size", Kind.INT, 50_000_000, "gather the next units ahead of use while "
             "they total under this (\"auto\": 0.9 hidden^2)", stage3=True),
    honoured(Z + "stage3_param_persistence_threshold", Kind.INT, 100_000, "parameters with fewer elements stay "
             "gathered with the root unit through the step (\"auto\": 10 hidden)", stage3=True),
    always(Z + "stage3_max_reuse_distance", "zerokit frees a unit after forward and gathers it again for backward; "
           "it keeps no reuse window", Kind.INT, 1_000_000_000, stage3=True),
    always(Z + "stage3_gather_16bit_weights_on_model_save", "engine.full_state_dict() gathers the full weights one "
           "unit at a time whenever you ask", Kind.BOOL, False, stage3=True),
    always(Z + "stage3_use_all_reduce_for_fetch_params", "zerokit gathers each unit's flat buffer with one "
           "collective", Kind.BOOL, False, stage3=True),
    always(Z + "stage3_allgather_sequential", "zerokit gathers each unit's flat buffer with one collective",
           Kind.BOOL, False, stage3=True),
    always(Z + "stage3_model_persistence_threshold", "zerokit keeps every parameter under "
           "stage3_param_persistence_threshold with the root unit, with no global budget (a memory knob)",
           Kind.INT, sys.maxsize, stage3=True),
    always(Z + "stage3_module_granularity_threshold", f"fine-grained modules are fetched as one in zerokit "
           f"anyway: {UNITS}", Kind.INT, 0, stage3=True),
    zerokit_key(Z + "stage3_unit_classes", Kind.NAMES, (), "module class names whose instances become units",
                stage3=True),
    zerokit_key(Z + "stage3_min_unit_params", Kind.INT, 100_000, "auto-wrap: the fewest parameters a "
                "ModuleList/Sequential member needs to become a unit", stage3=True),
)

# DeepSpeed spells the stage-3 keys with or without the stage3_ prefix; the prefixed one is what its docs write.
UNPREFIXED = ("max_live_parameters", "prefetch_bucket_size", "param_persistence_threshold", "max_reuse_distance",
              "gather_16bit_weights_on_model_save", "use_all_reduce_for_fetch_params", "allgather_sequential",
              "model_persistence_threshold", "module_granularity_threshold")
_KIND = {key.path: key.kind for key in STAGE3}
ALIASES = (
    *(alias(Z + name, Z + "stage3_" + name, _KIND[Z + "stage3_" + name], stage3=True) for name in UNPREFIXED),
    alias(Z + "stage3_gather_fp16_weights_on_model_save", Z + "stage3_gather_16bit_weights_on_model_save",
          Kind.BOOL, stage3=True),
    alias(Z + "cpu_offload", Z + "offload_optimizer", Kind.BOOL, "true is read as offload_optimizer.device=cpu"),
    alias(Z + "cpu_offload_param", Z + "offload_param", Kind.BOOL, "true is read as offload_param.device=cpu"),
    alias(Z + "cpu_offload_use_pin_memory", Z + "offload_optimizer.pin_memory", Kind.BOOL,
          "read as pin_memory of the offload blocks it turns on"),
)

ZEROKIT_ZERO = (
    zerokit_key(Z + "reduce_bucket_bytes", Kind.INT, None, "bytes per gradient bucket (instead of "
                "reduce_bucket_size elements)"),
    zerokit_key(Z + "reduce_every_micro_step", Kind.BOOL, True, "stage 2: reduce-scatter every micro-step (true) "
                "or accumulate full gradients and reduce once per step (false)"),
)

DEVICES = ("none", "cpu", "nvme")


def _offload(section: str, buffer_count: int) -> tuple[Key, ...]:
    path = Z + section + "."
    return (
        block(Z + section, f"{'parameters' if section == 'offload_param' else 'optimizer state'} on cpu or nvme"),
        honoured(path + "device", Kind.CHOICE, "none", "none, cpu or nvme", choices=DEVICES),
        honoured(path + "nvme_path", Kind.STR, None, "the NVMe mount to offload to (needed with nvme)"),
        honoured(path + "pin_memory", Kind.BOOL, True, "page-locked host memory for asynchronous copies"),
        honoured(path + "buffer_count", Kind.INT, buffer_count, "buffers in the NVMe swap pool"),
    )


OFFLOAD = (
    *_offload("offload_param", 5),
    honoured(Z + "offload_param.buffer_size", Kind.INT, 100_000_000, "elements per NVMe swap buffer"),
    honoured(Z + "offload_param.max_in_cpu", Kind.INT, 1_000_000_000, "parameter elements kept in host memory "
             "with nvme"),
    *_offload("offload_optimizer", 4),
    honoured(Z + "offload_optimizer.ratio", Kind.FLOAT, 1.0, "share of the optimizer step done on the CPU "
             "(below 1: stage 3 only)"),
    honoured(Z + "offload_optimizer.fast_init", Kind.BOOL, False, "fast optimizer initialisation with nvme"),
    honoured(Z + "offload_optimizer.pipeline_read", Kind.BOOL, False, "overlap reading the next NVMe tile with "
             "the step"),
    honoured(Z + "offload_optimizer.pipeline_write", Kind.BOOL, False, "overlap writing the previous NVMe tile "
             "with the step"),
    always(Z + "offload_optimizer.super_offload", "SuperOffload's CPU Adam for superchips is a speed path; "
           "zerokit's CPU tier steps with torch's CPU optimizer", Kind.BOOL, False),
    always(Z + "offload_optimizer.cpuadam_cores_perc", "used only by DeepSpeed's SuperOffload CPU Adam; zerokit's "
           "CPU step uses torch's threads", Kind.FLOAT, 0.8),
)

# DeepSpeed 0.19.8 removed MiCS; zerokit offers it with DeepSpeed's meaning (See [Note: hybrid sharding] in
# comm/groups.py)
MICS = (
    honoured(Z + "mics_shard_size", Kind.INT, -1, "stages 1-3: shard the model states over groups of this many "
             "consecutive ranks and replicate them across the groups (MiCS/HSDP); -1: one group over every rank",
             auto=False),
    always(Z + "mics_hierarchical_params_gather", "zerokit gathers parameters inside the shard group, which a "
           "node holds when mics_shard_size is the ranks per node: a hierarchical gather only changes its speed",
           Kind.BOOL, False),
)

REMOVED_ZERO = (
    Key(Z + "zeropp_loco_param", KeyClass.REMOVED, note="LoCo-Zero++", why="DeepSpeed 0.19.8 removed it"),
)

KEYS: tuple[Key, ...] = (*CORE, *STAGE3, *ALIASES, *ZEROKIT_ZERO, *OFFLOAD, *MICS, *REMOVED_ZERO)
