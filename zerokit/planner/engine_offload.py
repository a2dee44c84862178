"""The engine's offload transfers per optimizer step, exactly, from the same bucket layout as engine_model.py.

[Note: offload traffic, copy by copy]
What `engine.comm_stats()` counts under device_to_host, host_to_device, nvme_read and nvme_write over one
optimizer step, once the optimizer's state exists (zerokit/tiers/homes.py, nvme_masters.py,
shards.py, nvme_shards.py). Per bucket, n = this rank's shard of it (padding included), p = compute-dtype
bytes, r = reduce-dtype bytes:
  gradient down, once per step (each bucket's reduction at the accumulation boundary hands it over; the
  micro-steps before it accumulate on the device, so m does not multiply it):
      masters in host memory (offload_optimizer=cpu): device_to_host n elements of r bytes;
      masters on NVMe: the reduced shard is widened to fp32 on the device first, and each sub-group's part
      of it copied down as the sub-group is paged in: a call of s elements of 4 bytes per sub-group.
  updated shard up, once per step, only where the parameter shards live on the device:
      host_to_device n elements of p bytes (host masters; on CUDA the host casts to p first); NVMe masters
      publish each sub-group's part as it is stepped, a call of s elements each.
      Shards in host memory take the update there (nothing crosses); shards on NVMe are written:
      nvme_write round_up(c p, 4096) for each chunk of each shard the host cache (max_in_cpu) did not
      take (NVMe masters fill a chunk sub-group by sub-group, and it is written once, when whole).
      Masters left on the device with offloaded shards count device_to_host n elements of p bytes
      (shards in host memory) or of 4 bytes, the fp32 master (shards on NVMe), as the two homes count.
  optimizer on NVMe, each sub-group once per step: nvme_read and nvme_write of its whole record, counted
      in bytes (uint8 elements): round_up(4 s, 64) of fp32 values, then each piece's state tensors (keys
      sorted, STATE_TENSORS) each at a 64-byte boundary, the whole rounded up to 4096. A master's
      pieces are its parameter parts cut to piece_numel elements (64K: it lives in host memory), each
      with its own 4-byte step count; its sub-groups are runs of them of at most sub_group_size
      elements (unset: NVME_SUB_GROUP_NUMEL; a larger piece alone), the last to the master's end (See
      [Note: paging a master through a bounded pool]). (The first step reads records before the state
      exists.)
  stage-3 parameter fetches (offload_param=cpu|nvme): every gather of a bucket's shard copies it to the
      device, host_to_device n elements of p bytes, trainable buckets and each unit's frozen buffer alike:
      per micro-step each unit before its forward and, except the root, before its backward; a
      persistent unit only when the step publishes it (its trainable buckets; its frozen buffer never
      changes). Units are assumed to run in their index order, as they do in a model whose modules are
      registered in the order they run. A shard on NVMe outside the host cache is also read, chunk by
      chunk (c: at most buffer_size elements), nvme_read round_up(c p, 4096) each, and each read starts
      reading the chunk that was read after it the time before (See [Note: parameter shards on NVMe]);
      such a read-ahead that the step's write of the chunk overtakes is read for nothing: the last fetch
      of a step reads ahead the step's first chunk, which the publish rewrites. `_ReadAhead` replays this,
      so the count is the engine's, waste included. With hpZ only each bucket's first gather of a step
      fetches its shard: every later one reads the secondary copy (See [Note: hpZ's secondary copy]).
The host cache (max_in_cpu elements) takes shards in bucket order, trainable first, each one that still
fits, then the frozen buffers with what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerokit.config.defaults import NVME_SUB_GROUP_NUMEL
from zerokit.planner.engine_model import (BucketPlan, EngineSetup, ParamInventory, UnitPlan, add_count,
                                          persistent_units, round_up, stage3_units, stage_buckets, stage_parts)
from zerokit.planner.spec import BYTES_PER_ELEMENT
from zerokit.tiers.read_order import ReadOrder

# The same state as torch keeps it per piece, as (key, bytes per element, bytes per piece), keys sorted as an
# NVMe record stores them (zerokit/tiers/nvme_masters.py): Adam's moments and its 0-d fp32 step count.
STATE_TENSORS = {"adamw": (("exp_avg", 4, 0), ("exp_avg_sq", 4, 0), ("step", 0, 4)),
                 "adam": (("exp_avg", 4, 0), ("exp_avg_sq", 4, 0), ("step", 0, 4)),
                 "sgd-momentum": (("momentum_buffer", 4, 0),), "sgd": ()}
NVME_BLOCK = 4096  # every swap record's size is a multiple of it (zerokit/tiers/swap.py, direct I/O)
NVME_TENSOR_ALIGN = 64  # each state tensor of an optimizer record starts at such a boundary
TRANSFERS = ("device_to_host", "host_to_device", "nvme_read", "nvme_write")


def engine_transfers(inventory: ParamInventory, setup: EngineSetup, rank: int = 0) -> dict[str, dict[str, int]]:
    """The growth of comm_stats()'s transfer kinds over one optimizer step of `setup.grad_accum` micro-steps,
    the optimizer's state existing (from the second step on), on rank `rank`. Kinds with no call are absent.
    See [Note: offload traffic, copy by copy]; with split experts, both stages' (See [Note: split experts in the
    engine model] in engine_model.py)."""
    stats: dict[str, dict[str, int]] = {}
    if setup.offload_optimizer == "none" and setup.offload_param == "none":
        return stats
    for part in stage_parts(inventory, setup):
        _stage_transfers(stats, part.inventory, part.setup, part.rank(rank))
    return {kind: stats[kind] for kind in TRANSFERS if kind in stats}


def _stage_transfers(stats: dict, inventory: ParamInventory, setup: EngineSetup, rank: int) -> None:
    buckets = stage_buckets(inventory, setup)
    rank %= setup.shard_size  # its index in its shard group (See [Note: hybrid sharding] in zerokit/comm/groups.py)
    _gradients_down(stats, buckets, setup, rank)
    _updates_out(stats, buckets, setup, rank)
    if setup.offload_optimizer == "nvme":
        for bucket in buckets:
            for record in optimizer_records(bucket.shard_numel, bucket.slices(rank), setup):
                add_count(stats, "nvme_read", 1, record.nbytes, 1)
                add_count(stats, "nvme_write", 1, record.nbytes, 1)
    if setup.offload_param != "none":
        _parameter_fetches(stats, inventory, setup, buckets)


def _gradients_down(stats: dict, buckets: tuple[BucketPlan, ...], setup: EngineSetup, rank: int) -> None:
    """Each master's reduced gradient shard to the host, once per step (NVMe: sub-group by sub-group)."""
    if setup.offload_optimizer == "none":
        return
    for bucket in buckets:
        if setup.offload_optimizer == "nvme":
            for record in optimizer_records(bucket.shard_numel, bucket.slices(rank), setup):
                add_count(stats, "device_to_host", 1, record.numel, 4)
        else:
            add_count(stats, "device_to_host", 1, bucket.shard_numel, BYTES_PER_ELEMENT[setup.reduce_dtype])


def _updates_out(stats: dict, buckets: tuple[BucketPlan, ...], setup: EngineSetup, rank: int) -> None:
    """Updated masters -> compute shards, where that crosses a tier (NVMe shards: in `_parameter_fetches`)."""
    p = BYTES_PER_ELEMENT[setup.precision]
    for bucket in buckets:
        if setup.offload_param == "none" and setup.offload_optimizer == "nvme":
            for record in optimizer_records(bucket.shard_numel, bucket.slices(rank), setup):
                add_count(stats, "host_to_device", 1, record.numel, p)
        elif setup.offload_param == "none" and setup.offload_optimizer != "none":
            add_count(stats, "host_to_device", 1, bucket.shard_numel, p)
        elif setup.offload_param != "none" and setup.offload_optimizer == "none":
            add_count(stats, "device_to_host", 1, bucket.shard_numel, p if setup.offload_param == "cpu" else 4)


@dataclass(frozen=True)
class OptimizerRecord:
    """One NVMe optimizer record: a sub-group of `numel` master elements, `nbytes` with its optimizer state."""

    numel: int
    nbytes: int


def optimizer_records(numel: int, parts: list[int], setup: EngineSetup) -> list[OptimizerRecord]:
    """The NVMe records of a master of `numel` elements holding parameter parts `parts`, with their optimizer
    state (See [Note: paging a master through a bounded pool] in zerokit/tiers/nvme_masters.py)."""
    size = setup.sub_group_size if setup.sub_group_size is not None else NVME_SUB_GROUP_NUMEL
    runs: list[list[int]] = []  # runs of consecutive pieces of at most `size` elements (a larger piece alone)
    for piece in (piece for part in parts for piece in _pieces(part, setup.piece_numel)):
        if runs and runs[-1] and sum(runs[-1]) + piece <= size:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    if not numel:
        return []
    if not runs:
        runs.append([])  # a shard of padding alone
    sizes = [sum(run) for run in runs]
    sizes[-1] = numel - sum(sizes[:-1])  # the last one runs to the master's end, padding included
    return [OptimizerRecord(size, _record_bytes(size, run, setup)) for size, run in zip(sizes, runs)]


def _record_bytes(numel: int, pieces: list[int], setup: EngineSetup) -> int:
    offset = round_up(4 * numel, NVME_TENSOR_ALIGN)
    for piece in pieces:
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
    if setup.settings.secondary_size > 1:  # hpZ: only a bucket's first gather of a step reads its (primary) shard
        step = list(dict.fromkeys(step))
    step += [("write", ("trainable", b.index)) for b in buckets]
    step += [("fetch", ("trainable", b.index)) for b in buckets if b.unit in kept]
    return _StepEvents(start, step)


def _shard_numels(inventory: ParamInventory, setup: EngineSetup,
                  buckets: tuple[BucketPlan, ...]) -> dict[RecordKey, int]:
    """Each shard's elements, in the order the engine allocates them: trainable buckets, then the frozen
    buffers in the frozen layout's order (by each unit's last frozen parameter in registration order)."""
    numels: dict[RecordKey, int] = {("trainable", b.index): b.shard_numel for b in buckets}
    units = stage3_units(inventory, setup, buckets)
    last = {e.unit: position for position, e in enumerate(inventory.entries) if not e.trainable and e.floating}
    for unit in sorted((u for u in units if u.frozen_numel), key=lambda u: last[u.index]):
        numels[("frozen", unit.index)] = unit.frozen_numel // setup.shard_size
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


ChunkKey = tuple[RecordKey, int]  # a shard's record, and which of its chunks


class _ReadAhead:
    """NvmeShards' reads of chunks (zerokit/tiers/nvme_shards.py): a fetch takes the read already started
    for its chunk or starts one, then starts reading the chunk that followed it last time, dropping any other
    read still pending; a write drops a read still pending for its chunk (dropped reads were read all the
    same)."""

    def __init__(self) -> None:
        self.order: ReadOrder[ChunkKey] = ReadOrder()  # the engine's own guess of what comes next
        self.pending: set[ChunkKey] = set()
        self.reads: list[ChunkKey] = []

    def fetch(self, key: ChunkKey) -> None:
        if key in self.pending:
            self.pending.discard(key)
        else:
            self.reads.append(key)
        ahead = self.order.read(key)
        if ahead is None:
            return
        self.pending &= {ahead}
        if ahead not in self.pending:
            self.pending.add(ahead)
            self.reads.append(ahead)

    def write(self, key: ChunkKey) -> None:
        self.pending.discard(key)


def _chunks(numel: int, setup: EngineSetup) -> list[int]:
    """A shard's chunks on NVMe: at most buffer_size elements each (0: the whole shard)."""
    size = setup.buffer_size or max(numel, 1)
    return [min(size, numel - start) for start in range(0, numel, size)]


def _parameter_fetches(stats: dict, inventory: ParamInventory, setup: EngineSetup,
                       buckets: tuple[BucketPlan, ...]) -> None:
    """Stage 3's gathers from offloaded shards, and their NVMe reads and writes, in the steady state: the
    read-ahead learns the order in the first step and reads across the step boundary from the second on, so
    start-up and two steps are replayed uncounted, then one step counted."""
    events = _stage3_events(inventory, setup, buckets)
    numels = _shard_numels(inventory, setup, buckets)
    chunks = {key: _chunks(numel, setup) for key, numel in numels.items() if key in _on_file(numels, setup)}
    reader = _ReadAhead()
    for phase in (events.start, events.step, events.step):
        _replay(phase, numels, chunks, reader, None, setup)
    _replay(events.step, numels, chunks, reader, stats, setup)


def _replay(events: list[tuple[str, RecordKey]], numels: dict[RecordKey, int], chunks: dict[RecordKey, list[int]],
            reader: _ReadAhead, stats: dict | None, setup: EngineSetup) -> None:
    """Run `events` through the shard home, counting its transfers into `stats` (None: not counted). `chunks`:
    those of the shards on NVMe."""
    p = BYTES_PER_ELEMENT[setup.precision]
    reads_before = len(reader.reads)
    for action, key in events:
        if action == "fetch" and stats is not None:
            add_count(stats, "host_to_device", 1, numels[key], p)
        for index, size in enumerate(chunks.get(key, ())):
            if action == "fetch":
                reader.fetch((key, index))
            else:
                reader.write((key, index))
                if stats is not None:
                    add_count(stats, "nvme_write", 1, round_up(size * p, NVME_BLOCK), 1)
    if stats is not None:
        for key, index in reader.reads[reads_before:]:
            add_count(stats, "nvme_read", 1, round_up(chunks[key][index] * p, NVME_BLOCK), 1)
