"""Observability, activation checkpointing, checkpoints and I/O blocks."""

from __future__ import annotations

from zerokit.config.dsconfig.keys import (zerokit_key, Key, KeyClass, Kind, always, block, honoured, refused,
                                          refused_block)

SHARED_FILES = ("zerokit's checkpoints are read by any rank on any world size, so every rank must see every "
                "rank's files (a shared filesystem)")
A = "activation_checkpointing."

OBSERVABILITY = (
    honoured("steps_per_print", Kind.INT, None, "log loss, LR, grad norm, loss scale, skips and step time every N "
             "optimizer steps (logger 'zerokit', rank 0)"),
    honoured("wall_clock_breakdown", Kind.BOOL, False, "time forward, backward, reduction and optimizer step"),
    block("comms_logger", "log comm_stats() per step"),
    honoured("comms_logger.enabled", Kind.BOOL, False, "log what each collective moved"),
    honoured("comms_logger.verbose", Kind.BOOL, False, "log every collective as it is issued"),
    honoured("comms_logger.prof_all", Kind.BOOL, True, "profile every collective kind"),
    honoured("comms_logger.debug", Kind.BOOL, False, "name the caller of each collective"),
    honoured("comms_logger.prof_ops", Kind.NAMES, (), "only these collective kinds (with prof_all false)"),
    block("flops_profiler", "model FLOPs at one step (torch.utils.flop_counter)"),
    honoured("flops_profiler.enabled", Kind.BOOL, False, "count FLOPs at profile_step"),
    honoured("flops_profiler.profile_step", Kind.INT, 1, "the optimizer step to profile"),
    honoured("flops_profiler.module_depth", Kind.INT, -1, "module depth to aggregate at (-1: all)"),
    honoured("flops_profiler.top_modules", Kind.INT, 1, "how many top modules to report"),
    honoured("flops_profiler.detailed", Kind.BOOL, True, "report per module"),
    honoured("flops_profiler.output_file", Kind.STR, None, "write the report here (null: the log)", nullable=True),
    honoured("flops_profiler.recompute_fwd_factor", Kind.FLOAT, 0.0, "extra forward share recomputed by "
             "activation checkpointing"),
)


def _monitor(name: str, what: str) -> tuple[Key, ...]:
    return (block(name, what), honoured(name + ".enabled", Kind.BOOL, False, "write the training metrics"),
            honoured(name + ".output_path", Kind.STR, "", "directory (empty: the working directory)"),
            honoured(name + ".job_name", Kind.STR, "DeepSpeedJobName", "sub-directory for this run"))


MONITORS = (
    *_monitor("tensorboard", "metrics through torch.utils.tensorboard"),
    *_monitor("csv_monitor", "metrics as CSV files"),
    block("wandb", "metrics to Weights & Biases (needs the wandb package)"),
    honoured("wandb.enabled", Kind.BOOL, False, "log to wandb"),
    honoured("wandb.group", Kind.STR, None, "wandb group", nullable=True),
    honoured("wandb.team", Kind.STR, None, "wandb team (entity)", nullable=True),
    honoured("wandb.project", Kind.STR, "deepspeed", "wandb project"),
    refused_block("comet", "logging to Comet", "zerokit writes to tensorboard, csv_monitor and wandb"),
)

ACTIVATION = (
    block("activation_checkpointing", "how checkpointed activations are kept"),
    honoured(A + "partition_activations", Kind.BOOL, False, "partition checkpoints over model-parallel ranks (a "
             "no-op without model parallelism)"),
    honoured(A + "cpu_checkpointing", Kind.BOOL, False, "keep checkpointed activations in host memory"),
    honoured(A + "contiguous_memory_optimization", Kind.BOOL, False, "copy partitioned checkpoints into one "
             "buffer"),
    honoured(A + "number_checkpoints", Kind.INT, None, "checkpoints per step, to size that buffer", nullable=True),
    honoured(A + "synchronize_checkpoint_boundary", Kind.BOOL, False, "synchronise the device at each checkpoint"),
    honoured(A + "profile", Kind.BOOL, False, "log forward/backward time of each checkpointed function"),
    zerokit_key(A + "checkpoint_units", Kind.BOOL, False, "stage 3: checkpoint every unit's forward (recomputed in "
                "backward), without wrapping modules by hand", stage3=True),
)

C = "checkpoint."
CHECKPOINT = (
    block("checkpoint", "how save_checkpoint/load_checkpoint behave"),
    honoured(C + "tag_validation", Kind.CHOICE, "Warn", "when ranks pass different tags to save_checkpoint: Ignore or "
             "Warn (saved under rank 0's tag) or Fail", choices=("Ignore", "Warn", "Fail")),
    zerokit_key(C + "async_save", Kind.BOOL, False, "save_checkpoint returns once this rank's state is copied to host "
                "memory and writes it in the background (the argument async_save=/asynchronous= overrides it)",
                auto=False),
    always(C + "load_universal", "every zerokit checkpoint is universal: it loads on any world size and stage",
           Kind.BOOL, False),
    refused(C + "use_node_local_storage", "checkpoints on node-local storage", SHARED_FILES),
    always(C + "checkpoint_serialization", "zerokit writes safetensors files, whatever torch.save's serialization "
           "is set to", Kind.BOOL, True),
    block(C + "parallel_write", "parallel checkpoint writing (zerokit: every rank writes its own file)", ),
    always(C + "parallel_write.pipeline_stage", "zerokit has no pipeline stages: every rank writes its own file",
           Kind.BOOL, False),
    Key(C + "writer", KeyClass.ALWAYS, Kind.BLOCK, None, "DeepSpeed's fast checkpoint writer is a speed path; "
        "zerokit has its own: save_checkpoint(async_save=True)"),
)

P = "preemption."
PREEMPTION = (
    block("preemption", "zerokit's own: on SIGTERM or SIGUSR1 finish the step in flight, save a checkpoint and "
          "exit with a code a scheduler reads as \"requeue\" (docs/reliability.md)", KeyClass.ZEROKIT),
    zerokit_key(P + "enabled", Kind.BOOL, False, "catch the signals and save at the next optimizer step's end",
                auto=False),
    zerokit_key(P + "save_dir", Kind.STR, None, "where the preemption checkpoint goes (needed when enabled)",
                auto=False, nullable=True),
    zerokit_key(P + "signals", Kind.NAMES, ("SIGTERM", "SIGUSR1"), "the signals that preempt", auto=False),
    zerokit_key(P + "exit_code", Kind.INT, 75, "the code the ranks exit with once saved (75, EX_TEMPFAIL: try "
                "again; torchrun restarts on any code but 0)", auto=False),
)

RESUME = (
    block("resume", "zerokit's own: at start-up, load the newest complete checkpoint in load_dir and the data position "
          "saved with it, else start fresh (docs/reliability.md)", KeyClass.ZEROKIT),
    zerokit_key("resume.load_dir", Kind.STR, None, "the directory the job saves its checkpoints in; null: no resume at "
                "start-up", auto=False, nullable=True),
)

AIO_NOTE = "libaio tuning for DeepSpeed's NVMe swapper; zerokit's NVMe tier does its own I/O"
AIO = (
    block("aio", "asynchronous NVMe I/O"),
    *(always("aio." + name, AIO_NOTE, kind, default) for name, kind, default in (
        ("block_size", Kind.INT, 1_048_576), ("queue_depth", Kind.INT, 8), ("intra_op_parallelism", Kind.INT, 1),
        ("thread_count", Kind.INT, 1), ("single_submit", Kind.BOOL, False), ("overlap_events", Kind.BOOL, True),
        ("use_gds", Kind.BOOL, False))),
)

TIMERS = (
    block("timers", "DeepSpeed's throughput timers"),
    block("timers.throughput", "the throughput timer"),
    always("timers.throughput.enabled", "zerokit times steps with wall_clock_breakdown and steps_per_print",
           Kind.BOOL, True),
    always("timers.throughput.synchronized", "zerokit times steps with wall_clock_breakdown and steps_per_print",
           Kind.BOOL, True),
)

KEYS: tuple[Key, ...] = (*OBSERVABILITY, *MONITORS, *ACTIVATION, *CHECKPOINT, *PREEMPTION, *RESUME, *AIO, *TIMERS)
