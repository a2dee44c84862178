"""The run recorder: a few real steps of an engine, measured in the planner's categories, to a file.

[Note: what a record measures, step by step]
  warm-up steps        untimed: the optimizer's state is created in the first step, kernels are picked
  timed steps          forward (with the loss), backward and step, each after a barrier, the slowest
                       rank's wall and CPU time; the resident high-water mark over these steps (before any profiling,
                       whose own buffers would stay resident)
  one profiled step    saved activations (forward and the loss) by block; the allocator's peak over the
                       step by phase; memory_stats() after backward and after the step; the growth of
                       comm_stats() over the step
  a collective replay  the profiled step's collectives again, alone (same kinds, calls and sizes): the
                       time communication takes without compute beside it
  an exchange step     with MoE experts split over ranks, one more step under the profiler: the all-to-alls of the
                       expert exchange, which no communicator counts (See [Note: counting the all-to-alls no
                       communicator counts] in measure.py), the mean over ranks (a rank's share of the routes varies)
Peaks and times are the maximum over ranks (what the job sees); memory_stats() and comm_stats() are
rank 0's (every rank holds and sends the same, up to the shard padding, which rank 0 has the most of, and,
across nodes, the bytes that cross them, which the planner predicts per rank: rank 0's here). A MiCS or hpZ
run is recorded like a flat one; its collectives are replayed over every rank.
Only the engine's public surface is used: engine(...), backward, step, memory_stats, comm_stats,
config, module, world_size, rank, comm.backend.
"""

from __future__ import annotations

import json
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
import torch.distributed as dist

from zerokit.config.typed import DTYPE_NAMES
from zerokit.masters.optimizer import fused_group
from zerokit.planner.engine_model import EngineSetup, per_kind
from zerokit.profiling.inventory import blocks_of, param_inventory
from zerokit.profiling.measure import (AllocationTimeline, SavedTensorCounter, all_to_all_counts, backward_phases,
                                      resident_peak)
from zerokit._support.jsonfile import JsonRecord
from zerokit.comm.process import default_device

LossFn = Callable[[Any, Any], torch.Tensor]
_LAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its latest RunRecord


@dataclass
class RunRecord(JsonRecord):
    """Everything `zerokit plan --check` needs: the configuration, the model's parameters, what was measured."""

    WHAT: ClassVar[str] = "run record"
    HINT: ClassVar[str] = "write one with zerokit.profiling.record_run"

    setup: dict
    inventory: dict
    model: dict
    """name, n_layers (blocks found), and the Hugging Face config when the module has one."""
    micro_batch: int
    seq_len: int
    measured: dict
    device: dict = field(default_factory=dict)
    version: int = 1



def engine_setup(engine: Any, optimizer_name: str) -> EngineSetup:
    config, settings = engine.config, engine.settings
    return EngineSetup(stage=config.stage, world=engine.world_size,
                       precision=DTYPE_NAMES[config.precision.param_dtype],
                       reduce_dtype=DTYPE_NAMES[config.precision.reduce_dtype], optimizer=optimizer_name,
                       fused_optimizer=steps_fused(engine.optimizer),
                       backend="nccl" if engine.comm.backend == "nccl" else "gloo",
                       device="cuda" if engine.comm.backend == "nccl" else "cpu",
                       reduce_scatter=config.reduce_scatter, bucket_bytes=config.reduce_bucket_bytes,
                       sub_group_size=config.sub_group_size, reduce_every_micro_step=config.reduce_every_micro_step,
                       grad_accum=config.gradient_accumulation_steps,
                       persistence_threshold=config.stage3.persistence_threshold,
                       offload_optimizer=config.offload_optimizer.device, offload_param=config.offload_param.device,
                       max_in_cpu=config.offload_param.max_in_cpu, buffer_size=config.offload_param.buffer_size,
                       broadcast_buffers=config.broadcast_buffers, mics_shard_size=settings.shard_size,
                       ranks_per_node=settings.ranks_per_node,
                       hpz_partition_size=settings.secondary_size,  # See [Note: hybrid sharding] in comm/groups.py
                       sequence=engine.layout.sequence if engine.layout is not None else 1,
                       expert=engine.layout.expert if engine.layout is not None else 1)


def engine_config(setup: dict) -> dict:
    """The config of `zerokit.initialize` for a recorded setup, as far as engine_setup records one (its inverse):
    copies of a recorded run are built with it."""
    zero = {"stage": setup["stage"], "reduce_bucket_bytes": setup["bucket_bytes"]}
    zero.update({name: setup[name] for name in ("reduce_scatter", "sub_group_size") if setup[name] is not None})
    if not setup["reduce_every_micro_step"]:
        zero["reduce_every_micro_step"] = False
    if setup["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = setup["persistence_threshold"]
    for kind in ("optimizer", "param"):
        device = setup[f"offload_{kind}"]
        if device == "none":
            continue
        block = zero[f"offload_{kind}"] = {"device": device}
        if device == "nvme":  # swap files in the temporary folder: a record does not keep the run's path
            block["nvme_path"] = tempfile.gettempdir()
        if kind == "param":
            block["max_in_cpu"] = setup["max_in_cpu"]
            if "buffer_size" in setup:  # records written before it was recorded: the default
                block["buffer_size"] = setup["buffer_size"]
    _hybrid_keys(setup, zero)
    config = {"zero_optimization": zero, "gradient_accumulation_steps": setup["grad_accum"],
              "communication_data_type": setup["reduce_dtype"], "broadcast_buffers": setup["broadcast_buffers"]}
    if setup.get("ranks_per_node") not in (None, setup["world"]):  # simulated nodes, as the run had them
        config["ranks_per_node"] = setup["ranks_per_node"]
    if setup["precision"] != "fp32":
        config[setup["precision"]] = {"enabled": True}
    if setup.get("expert", 1) > 1:  # copies are Hugging Face models (calibrate_for_record), split by this key
        config["expert_parallel"] = {"enabled": True, "autoep_size": setup["expert"]}
    return config


def _hybrid_keys(setup: dict, zero: dict) -> None:
    """MiCS's and hpZ's keys where the recorded run set them (a record made before they were recorded has none)."""
    shard_size, k = setup.get("mics_shard_size"), setup.get("hpz_partition_size")
    if shard_size not in (None, -1, setup["world"]):
        zero["mics_shard_size"] = shard_size
    if k not in (None, 1):
        zero["zero_hpz_partition_size"] = k


def steps_fused(optimizer: Any) -> bool:
    """Whether the engine's optimizer (or every one of a list) steps with a fused kernel: it decides the pieces."""
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    return all(fused_group(group) for item in optimizers for group in item.param_groups)


def optimizer_name(optimizer: Any) -> str:
    if isinstance(optimizer, (list, tuple)):  # the engine rebuilds a list when given several
        names = {optimizer_name(item) for item in optimizer}
        if len(names) != 1:
            raise ValueError(f"the planner models one optimizer kind per run; this engine steps {sorted(names)}")
        return names.pop()
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        return "sgd-momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
    if name in ("adam", "adamw"):
        return name
    raise ValueError(f"the planner models Adam, AdamW and SGD; {type(optimizer).__name__} is not one of them")


def _model_info(module: torch.nn.Module, blocks: list) -> dict:
    config = getattr(module, "config", None)
    hf = config.to_dict() if hasattr(config, "to_dict") else None
    if hf is not None:
        hf = json.loads(json.dumps(hf, default=str))  # torch dtypes and the like as strings
    return {"name": type(module).__name__, "n_layers": len(blocks), "hf_config": hf}


def _diff(after: dict, before: dict) -> dict:
    return {kind: {key: after[kind][key] - before.get(kind, {}).get(key, 0) for key in after[kind]}
            for kind in after if any(after[kind][key] - before.get(kind, {}).get(key, 0) for key in after[kind])}


def _one_step(engine: Any, loss_fn: LossFn, batches: Iterator) -> None:
    for _ in range(engine.config.gradient_accumulation_steps):
        engine.backward(loss_fn(engine, next(batches)))
        engine.step()


def _profiled_step(engine: Any, loss_fn: LossFn, batches: Iterator, blocks: list) -> dict:
    """See [Note: what a record measures, step by step]."""
    device = next(engine.module.parameters()).device
    start_states, comm_before = engine.memory_stats(), engine.comm_stats()
    counter = SavedTensorCounter(engine.module, blocks)
    accum = engine.config.gradient_accumulation_steps
    with AllocationTimeline(device) as allocated, backward_phases(blocks, allocated):
        for micro in range(accum):
            with counter:
                loss = loss_fn(engine, next(batches))
            allocated.mark("head")
            engine.backward(loss)
            del loss
            if micro == accum - 1:
                after_backward = engine.memory_stats()
                allocated.mark("step")
            engine.step()
    return {"after_backward": after_backward, "after_step": engine.memory_stats(),
            "activations": counter.total // accum, "activations_outside": counter.outside // accum,
            "activations_per_block": [b // accum for b in counter.per_block()],
            "peak_allocated": sum(start_states.values()) + allocated.peak, "phase_peaks": allocated.phase_peaks,
            "comm_per_step": _diff(engine.comm_stats(), comm_before)}


class _Clock:
    """Wall and CPU (all threads of this process) seconds per phase. CPU time leaves out waiting for a core
    that another process holds, so on a shared machine it is the steadier of the two."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.cpu: dict[str, float] = dict(self.wall)
        self.restart()

    def restart(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def lap(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.wall[phase] += wall - self._wall
        self.cpu[phase] += cpu - self._cpu
        self._wall, self._cpu = wall, cpu


def timed_steps(engine: Any, loss_fn: LossFn, batches: Iterator, steps: int) -> dict:
    """Wall and CPU seconds per phase of `steps` optimizer steps (per step), this rank's, and the resident peak."""
    clock = _Clock()
    with resident_peak() as resident:
        for _ in range(steps):
            for _ in range(engine.config.gradient_accumulation_steps):
                batch = next(batches)
                dist.barrier()
                clock.restart()
                loss = loss_fn(engine, batch)
                clock.lap("forward")
                engine.backward(loss)
                clock.lap("backward")
                engine.step()  # off the boundary it returns at once
                clock.lap("step")
    per_step = {phase: value / steps for phase, value in clock.wall.items()}  # per optimizer step
    per_step["total"] = sum(per_step.values())
    cpu = {phase: value / steps for phase, value in clock.cpu.items()}
    return {"seconds": per_step, "cpu_seconds": cpu, "peak_resident": resident["peak"],
            "resident_at_start": resident["start"], "resident_reset": resident["reset"],
            "micro_steps": engine.config.gradient_accumulation_steps}


def step_collectives(engine: Any, loss_fn: LossFn, batches: Iterator) -> dict:
    """The collectives of one optimizer step: calls, elements and bytes by kind."""
    before = engine.comm_stats()
    _one_step(engine, loss_fn, batches)
    return _diff(engine.comm_stats(), before)


def step_exchanges(engine: Any, loss_fn: LossFn, batches: Iterator) -> dict[str, float]:
    """The all-to-alls of one optimizer step that no communicator counts: calls, elements and bytes, the mean over
    ranks (See [Note: what a record measures, step by step])."""
    with all_to_all_counts() as counts:
        _one_step(engine, loss_fn, batches)
    summed = _over_ranks(list(counts.values()), dist.ReduceOp.SUM)
    return {key: value / engine.world_size for key, value in zip(counts, summed)}


def communication_seconds(engine: Any, comm: dict) -> float:
    """`comm` (a step's collectives) replayed alone, each kind in the dtype the engine sends it in."""
    dtypes = {"all_gather": engine.config.precision.param_dtype}
    return replay_collectives(comm, lambda kind: dtypes.get(kind, engine.config.precision.reduce_dtype),
                              next(engine.module.parameters()).device)


def slowest(values: dict[str, float]) -> dict[str, float]:
    """The largest value over the ranks, key by key."""
    return dict(zip(values, _max_over_ranks(list(values.values()))))


def replay_collectives(comm: dict, dtype_of: Callable[[str], torch.dtype], device: torch.device,
                       repeats: int = 5) -> float:
    """Seconds the step's collectives take alone: each kind's calls at its average size, in its dtype; the fastest
    of `repeats` replays, as timeit takes (on a shared machine a replay is only ever slowed by other work: the
    same run's mean of three moved by 30-50% from process to process)."""
    world = dist.get_world_size()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for kind, entry in per_kind(comm).items():  # every group together, as if over every rank
            if not entry["calls"]:
                continue
            dtype = dtype_of(kind) if entry["elements"] > 1 else torch.float64
            numel = max(world, entry["elements"] // entry["calls"] // world * world)
            tensor = torch.zeros(numel, dtype=dtype, device=device)
            for _ in range(entry["calls"]):
                _replay_one(kind, tensor, world)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return min(times)


def _replay_one(kind: str, tensor: torch.Tensor, world: int) -> None:
    if kind == "all_reduce":
        dist.all_reduce(tensor)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty(tensor.numel() // world, dtype=tensor.dtype, device=tensor.device),
                                   tensor)
    elif kind == "all_gather":  # as the engine does on gloo: each rank's slice broadcast from its owner
        for rank, chunk in enumerate(tensor.chunk(world)):
            dist.broadcast(chunk, src=rank)
    else:
        dist.broadcast(tensor, src=0)


def _max_over_ranks(values: list[float]) -> list[float]:
    return _over_ranks(values, dist.ReduceOp.MAX)


def _over_ranks(values: list[float], op: Any) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=default_device())  # NCCL reduces GPU tensors only
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def record_run(engine: Any, batches: Iterable, loss_fn: LossFn, *, optimizer: Any = None, param_groups: Any = None,
               micro_batch: int, seq_len: int, warmup: int = 2, steps: int = 3,
               path: str | Path | None = None) -> RunRecord:
    """Train `warmup + 1 + steps` optimizer steps of `engine` on `batches` and measure them (See [Note:
    what a record measures, step by step]). `loss_fn(engine, batch)` runs the forward and returns the
    loss; `optimizer` is the one given to zerokit.initialize (its class and param groups: pass
    `param_groups` if it is not at hand). Rank 0 writes the record to `path` if given."""
    batches = iter(batches)
    blocks = list(blocks_of(engine.module))
    optimizer = optimizer if optimizer is not None else getattr(engine, "user_optimizer", None)
    name = optimizer_name(engine.optimizer)
    setup = engine_setup(engine, name)
    inventory = param_inventory(engine.module, param_groups if param_groups is not None else optimizer,
                                engine.config.stage3)
    if optimizer is None and param_groups is None:
        raise ValueError("record_run needs the optimizer given to zerokit.initialize (optimizer=...) or its "
                         "param_groups, to lay out buckets as the engine does")
    for _ in range(warmup):
        _one_step(engine, loss_fn, batches)
    measured = timed_steps(engine, loss_fn, batches, steps)  # before profiling, whose buffers would stay resident
    measured.update(_profiled_step(engine, loss_fn, batches, blocks))
    if setup.expert > 1:
        measured["all_to_all"] = step_exchanges(engine, loss_fn, batches)
    device = next(engine.module.parameters()).device
    measured["seconds"]["communication"] = communication_seconds(engine, measured["comm_per_step"])
    keys = ["peak_allocated", "peak_resident", "resident_at_start"]
    peaks = _max_over_ranks([measured[k] for k in keys] + list(measured["seconds"].values())
                            + list(measured["cpu_seconds"].values()))
    measured.update(dict(zip(keys, map(int, peaks[:len(keys)]))))
    count = len(measured["seconds"])
    measured["seconds"] = dict(zip(measured["seconds"], peaks[len(keys):len(keys) + count]))
    measured["cpu_seconds"] = dict(zip(measured["cpu_seconds"], peaks[len(keys) + count:]))
    record = RunRecord(setup=asdict(setup), inventory=inventory.as_dict(), model=_model_info(engine.module, blocks),
                       micro_batch=micro_batch, seq_len=seq_len, measured=measured,
                       device={"type": device.type, "threads": torch.get_num_threads()})
    _LAST[engine] = record
    if path is not None and engine.rank == 0:
        record.save(path)
    return record


def last_record(engine: Any) -> RunRecord | None:
    return _LAST.get(engine)
