"""The engine's offload transfers per optimizer step, exactly, from the same bucket layout as engine_model.py.

[Note: offload traffic, copy by copy]
What `engine.comm_stats()` counts under device_to_host, host_to_device, nvme_read and nvme_write over one
optimizer step, once the optimizer's state exists (zerokit/masters/homes.py, nvme.py; zerokit/offload/
params.py, nvme_params.py). Per bucket, n = this rank's shard of it (padding included), p = compute-dtype
bytes, r = reduce-dtype bytes:
  gradient down, once per step (each bucket's reduction at the accumulation boundary hands it over; the
  micro-steps before it accumulate on the device, so m does not multiply it):
      masters in host memory (offload_optimizer=cpu): device_to_host n elements of r bytes;
      masters on NVMe: the reduced shard is widened to fp32 on the device first: n elements of 4 bytes.
  updated shard up, once per step, only where the parameter shards live on the device:
      host_to_device n elements of p bytes (host or NVMe masters; on CUDA the host casts to p first).
      Shards in host memory take the update there (nothing crosses); shards on NVMe are written:
      nvme_write round_up(n p, 4096) for each shard the host cache (max_in_cpu) did not take.
      Masters left on the device with offloaded shards count device_to_host n elements of p bytes
      (shards in host memory) or of 4 bytes, the fp32 master (shards on NVMe), as the two homes count.
  optimizer on NVMe, each master once per step: nvme_read and nvme_write of its whole record, counted
      in bytes (uint8 elements): round_up(4 n, 64) of fp32 values, then each piece's state tensors (keys
      sorted, STATE_TENSORS) each at a 64-byte boundary, the whole rounded up to 4096. A master's
      pieces are its parameter parts cut to piece_numel elements (64K: it lives in host memory), each
      with its own 4-byte step count. (The first step reads the record before the state exists.)
  stage-3 parameter fetches (offload_param=cpu|nvme): every gather of a bucket's shard copies it to the
      device, host_to_device n elements of p bytes, trainable buckets and each unit's frozen buffer alike:
      per micro-step each unit before its forward and, except the root, before its backward; a
      persistent unit only when the step publishes it (its trainable buckets; its frozen buffer never
      changes). Units are assumed to run in their index order, as they do in a model whose modules are
      registered in the order they run. A shard on NVMe outside the host cache is also read,
      nvme_read round_up(n p, 4096), and each read starts reading the record that was read after it the
      time before (See [Note: parameter shards on NVMe]); such a read-ahead that the step's write of the
      record overtakes is read for nothing: the last fetch of a step reads ahead the step's first record,
      which the publish rewrites. `_ReadAhead` replays this, so the count is the engine's, waste included.
The host cache (max_in_cpu elements) takes shards in bucket order, trainable first, each one that still
fits, then the frozen buffers with what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerokit.planner.engine_model import (BucketPlan, EngineSetup, ParamInventory, UnitPlan, add_count, engine_buckets,
                                          persistent_units, round_up, stage3_units)
from zerokit.planner.spec import BYTES_PER_ELEMENT

# The same state as torch keeps it per piece, as (key, bytes per element, bytes per piece), keys sorted as an
# NVMe record stores them (zerokit/masters/nvme.py): Adam's moments and its 0-d fp32 step count.
STATE_TENSORS = {"adamw": (("exp_avg", 4, 0), ("exp_avg_sq", 4, 0), ("step", 0, 4)),
                 "adam": (("exp_avg", 4, 0), ("exp_avg_sq", 4, 0), ("step", 0, 4)),
                 "sgd-momentum": (("momentum_buffer", 4, 0),), "sgd": ()}
NVME_BLOCK = 4096  # every swap record's size is a multiple of it (zerokit/offload/swap.py, direct I/O)
NVME_TENSOR_ALIGN = 64  # each state tensor of an optimizer record starts at such a boundary
TRANSFERS = ("device_to_host", "host_to_device", "nvme_read", "nvme_write")


def engine_transfers(inventory: ParamInventory, setup: EngineSetup, rank: int = 0) -> dict[str, dict[str, int]]:
    """The growth of comm_stats()'s transfer kinds over one optimizer step of `setup.grad_accum` micro-steps,
    the optimizer's state existing (from the second step on), on rank `rank`. Kinds with no call are absent.
    See [Note: offload traffic, copy by copy]."""
    stats: dict[str, dict[str, int]] = {}
    if setup.offload_optimizer == "none" and setup.offload_param == "none":
        return stats
    buckets = engine_buckets(inventory, setup)
    _gradients_down(stats, buckets, setup)
    _updates_out(stats, buckets, setup)
    if setup.offload_optimizer == "nvme":
        for bucket in buckets:
            record = optimizer_record_bytes(bucket.shard_numel, bucket.slices(rank), setup)
            add_count(stats, "nvme_read", 1, record, 1)
            add_count(stats, "nvme_write", 1, record, 1)
    if setup.offload_param != "none":
        _parameter_fetches(stats, inventory, setup, buckets)
    return {kind: stats[kind] for kind in TRANSFERS if kind in stats}


def _gradients_down(stats: dict, buckets: tuple[BucketPlan, ...], setup: EngineSetup) -> None:
    """Each master's reduced gradient shard to the host, once per step."""
    if setup.offload_optimizer == "none":
        return
    element = 4 if setup.offload_optimizer == "nvme" else BYTES_PER_ELEMENT[setup.reduce_dtype]
    for bucket in buckets:
        add_count(stats, "device_to_host", 1, bucket.shard_numel, element)


def _updates_out(stats: dict, buckets: tuple[BucketPlan, ...], setup: EngineSetup) -> None:
    """Updated masters -> compute shards, where that crosses a tier (NVMe shards: in `_parameter_fetches`)."""
    p = BYTES_PER_ELEMENT[setup.precision]
    for bucket in buckets:
        if setup.offload_param == "none" and setup.offload_optimizer != "none":
            add_count(stats, "host_to_device", 1, bucket.shard_numel, p)
        elif setup.offload_param != "none" and setup.offload_optimizer == "none":
            add_count(stats, "device_to_host", 1, bucket.shard_numel, p if setup.offload_param == "cpu" else 4)


def optimizer_record_bytes(numel: int, parts: list[int], setup: EngineSetup) -> int:
    """Bytes of one NVMe optimizer record: a master of `numel` elements holding parameter parts `parts`,
    with its optimizer state (See [Note: paging a master through a bounded pool] in zerokit/masters/nvme.py)."""
    offset = round_up(4 * numel, NVME_TENSOR_ALIGN)
    for part in parts:
        for piece in _pieces(part, setup.piece_numel):
            for _key, per_element, per_piece in STATE_TENSORS[setup.optimizer]:
                offset = round_up(offset + per_element * piece + per_piece, NVME_TENSOR_ALIGN)
    return round_up(offset, NVME_BLOCK)


def _pieces(part: int, piece_numel: int) -> list[int]:
    whole, rest = divmod(part, piece_numel)
    return [piece_numel] * whole + ([rest] if rest else [])


RecordKey = tuple[str, int]  # ("trainable", bucket index) or ("frozen", unit index)


@dataclass(frozen=True)
class _StepEvents:
    """The shard-home calls of stage 3, in order: at start-up, per optimizer step; each ("fetch" | "write", key)."""

    start: list[tuple[str, RecordKey]]
    step: list[tuple[str, RecordKey]]


def _stage3_events(inventory: ParamInventory, setup: EngineSetup, buckets: tuple[BucketPlan, ...]) -> _StepEvents:
    """See [Note: the stage-3 step] in zerokit/stages/hooks.py: forward in unit order (the root first), backward
    in reverse without the root; the publish writes every trainable shard in bucket order, then the persistent
    units' trainable buckets are gathered again. At start-up every shard is written, unit by unit, and the
    persistent units are gathered."""
    units = stage3_units(inventory, setup, buckets)
    kept = {u.index for u in persistent_units(units, setup)}

    def parts(unit: UnitPlan) -> list[RecordKey]:
        own = [("trainable", b.index) for b in buckets if b.unit == unit.index]
        return own + ([("frozen", unit.index)] if unit.frozen_numel else [])

    start = [("write", key) for unit in units for key in parts(unit)]
    start += [("fetch", key) for unit in units if unit.index in kept for key in parts(unit)]
    sharded = [unit for unit in units if unit.index not in kept]
    micro = sharded + [unit for unit in reversed(sharded) if unit.index != 0]
    step = [("fetch", key) for _ in range(setup.grad_accum) for unit in micro for key in parts(unit)]
    step += [("write", ("trainable", b.index)) for b in buckets]
    step += [("fetch", ("trainable", b.index)) for b in buckets if b.unit in kept]
    return _StepEvents(start, step)


def _shard_numels(inventory: ParamInventory, setup: EngineSetup, buckets: tuple[BucketPlan, ...]) -> dict[RecordKey, int]:
    """Each shard's elements, in the order the engine allocates them: trainable buckets, then the frozen
    buffers in the frozen layout's order (by each unit's last frozen parameter in registration order)."""
    numels: dict[RecordKey, int] = {("trainable", b.index): b.shard_numel for b in buckets}
    units = stage3_units(inventory, setup, buckets)
    last = {e.unit: position for position, e in enumerate(inventory.entries) if not e.trainable and e.floating}
    for unit in sorted((u for u in units if u.frozen_numel), key=lambda u: last[u.index]):
        numels[("frozen", unit.index)] = unit.frozen_numel // setup.world
    return numels


def _on_file(numels: dict[RecordKey, int], setup: EngineSetup) -> set[RecordKey]:
    """The shards the host cache (max_in_cpu elements) does not take: each that still fits goes in, in order."""
    if setup.offload_param != "nvme":
        return set()
    cached, outside = 0, set()
    for key, numel in numels.items():
        if cached + numel <= setup.max_in_cpu:
            cached += numel
        else:
            outside.add(key)
    return outside


class _ReadAhead:
    """NvmeShards' reads of records (zerokit/offload/nvme_params.py): a fetch takes the read already started
    for its record or starts one, then starts reading the record that followed it last time; a write drops
    a read still pending for its record (its bytes were read all the same)."""

    def __init__(self) -> None:
        self.following: dict[RecordKey, RecordKey] = {}
        self.last: RecordKey | None = None
        self.pending: set[RecordKey] = set()
        self.reads: list[RecordKey] = []

    def fetch(self, key: RecordKey) -> None:
        if key in self.pending:
            self.pending.discard(key)
        else:
            self.reads.append(key)
        if self.last is not None and self.last != key:
            self.following[self.last] = key
        self.last = key
        ahead = self.following.get(key)
        if ahead is not None and ahead not in self.pending and ahead != key:
            self.pending.add(ahead)
            self.reads.append(ahead)

    def write(self, key: RecordKey) -> None:
        self.pending.discard(key)


def _parameter_fetches(stats: dict, inventory: ParamInventory, setup: EngineSetup,
                       buckets: tuple[BucketPlan, ...]) -> None:
    """Stage 3's gathers from offloaded shards, and their NVMe reads and writes, in the steady state: the
    read-ahead learns the order in the first step and reads across the step boundary from the second on, so
    start-up and two steps are replayed uncounted, then one step counted."""
    events = _stage3_events(inventory, setup, buckets)
    numels = _shard_numels(inventory, setup, buckets)
    on_file = _on_file(numels, setup)
    reader = _ReadAhead()
    for phase in (events.start, events.step, events.step):
        _replay(phase, numels, on_file, reader, None, setup)
    _replay(events.step, numels, on_file, reader, stats, setup)


def _replay(events: list[tuple[str, RecordKey]], numels: dict[RecordKey, int], on_file: set[RecordKey],
            reader: _ReadAhead, stats: dict | None, setup: EngineSetup) -> None:
    """Run `events` through the shard home, counting its transfers into `stats` (None: not counted)."""
    p = BYTES_PER_ELEMENT[setup.precision]
    reads_before = len(reader.reads)
    for action, key in events:
        if action == "fetch":
            if stats is not None:
                add_count(stats, "host_to_device", 1, numels[key], p)
            if key in on_file:
                reader.fetch(key)
        elif key in on_file:
            reader.write(key)
            if stats is not None:
                add_count(stats, "nvme_write", 1, round_up(numels[key] * p, NVME_BLOCK), 1)
    if stats is not None:
        for key in reader.reads[reads_before:]:
            add_count(stats, "nvme_read", 1, round_up(numels[key] * p, NVME_BLOCK), 1)
