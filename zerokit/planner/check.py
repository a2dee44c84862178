"""A plan held against a run: the prediction for a recorded run's configuration, category by category.

[Note: predicting a recorded run]
A run record (zerokit/profiling/record.py) carries the engine's setup, the model's parameter inventory,
the micro-batch and sequence length, and what was measured. From the first three, without torch:
  - model states after backward and after the step, and every collective: engine_model.py, exact;
  - activations: the calibration's per-block and outside fits at (b, s) with the model's blocks, or
    Korthikanti's formula (memory.py) for a model the planner has shapes for;
  - the allocator's peak: the model states after the step plus the largest phase peak of a forward and
    backward (from the calibration: See [Note: extrapolating a calibration]) with what the engine adds
    in that phase: gathered stage-3 units (the root, the unit computing and the prefetched one), the
    reducer's in-flight buckets (MAX_BUCKETS_IN_FLIGHT + 1), in the backward's phases the gradient buffer
    (made at a window's first backward, let go of at its step), and at its tail the reduced gradients kept
    in the reduce dtype until the step; or the state after backward, if larger;
  - the resident peak: the framework's resident memory (measured), the model states, and the step's
    peak allocations times one plus the allocator's measured slack (See [Note: measuring allocator slack]);
  - times: each phase on the line through copies of the model timed at the run's stage, world size and
    shape (See [Note: timing copies] in zerokit/profiling/resident.py); without them, FLOPs (compute.py) at
    the device's measured peak x MFU, the optimizer at its measured seconds per element, collectives by the
    alpha-beta model with the measured link.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, replace

from zerokit.config.defaults import MAX_BUCKETS_IN_FLIGHT
from zerokit.planner.calibration import Calibration
from zerokit.planner.comms import expert_exchange_size
from zerokit.planner.compute import flops_per_token
from zerokit.planner.device import DeviceProfile, optimizer_key
from zerokit.planner.engine_model import (
    BYTES_PER_ELEMENT,
    EngineSetup,
    ParamInventory,
    engine_buckets,
    engine_comm,
    engine_states,
    per_kind,
    persistent_units,
    stage3_units,
    stage_buckets,
    stage_parts,
    wire_bytes,
)
from zerokit.planner.memory import activation_bytes
from zerokit.planner.models import ModelSpec, from_hf_dict, param_counts
from zerokit.planner.spec import Layout, Trainable, Training

STATE_CATEGORIES = ("parameters", "gradients", "optimizer_state")


@dataclass(frozen=True)
class Row:
    category: str
    unit: str
    """bytes, seconds or count."""
    predicted: float | None
    measured: float | None
    note: str = ""

    @property
    def error(self) -> float | None:
        if self.predicted is None or self.measured is None or self.measured == 0:
            return None if self.predicted != self.measured else 0.0
        return self.predicted / self.measured - 1

    def as_dict(self) -> dict:
        suffix = {"bytes": "bytes", "seconds": "seconds"}.get(self.unit, "count")
        return {"category": self.category, "unit": self.unit, f"predicted_{suffix}": self.predicted,
                f"measured_{suffix}": self.measured, "predicted": self.predicted, "measured": self.measured,
                "error": self.error, "note": self.note}


def model_spec(record: dict) -> ModelSpec | None:
    hf = record["model"].get("hf_config")
    try:
        return from_hf_dict(hf, "the run's model config") if hf else None
    except ValueError:
        return None


def _training(record: dict, setup: EngineSetup, attention: str = "eager") -> Training:
    return Training(precision=setup.precision, seq_len=record["seq_len"], micro_batch=record["micro_batch"],
                    grad_accum=setup.grad_accum, attention=attention, reduce_dtype=setup.reduce_dtype,
                    bucket_bytes=setup.bucket_bytes, trainable=Trainable())


def predicted_activations(record: dict, setup: EngineSetup, calibration: Calibration | None) -> tuple[int | None, str]:
    """A rank's saved activations: the replica's over the whole sequences (`seq_len`), split over its sequence ranks
    as memory.py's activation_bytes splits them (a record's calibration is of the model, on whole sequences)."""
    b, s, layers = record["micro_batch"], record["seq_len"], record["model"].get("n_layers") or None
    if calibration is not None:
        return (math.ceil(calibration.activations(b, s, layers) / setup.sequence),
                f"calibrated on {calibration.model} ({calibration.device})")
    spec = model_spec(record)
    if spec is None or spec.architecture is None:
        return None, "no calibration and no shapes"
    return (activation_bytes(spec, _training(record, setup), Layout(sp=setup.sequence)),
            "formula (Korthikanti et al. 2022), eager")


def engine_extras(inventory: ParamInventory, setup: EngineSetup, grads_kept: int) -> dict[str, int]:
    """What the engine adds to a forward-backward's phase peaks. See [Note: predicting a recorded run]."""
    buckets = engine_buckets(inventory, setup)
    p, r = BYTES_PER_ELEMENT[setup.precision], BYTES_PER_ELEMENT[setup.reduce_dtype]
    largest = sorted((b.numel for b in buckets), reverse=True)[:MAX_BUCKETS_IN_FLIGHT + 1]
    copies = setup.stage >= 2 or (setup.stage == 1 and setup.precision != setup.reduce_dtype)
    staging = r * sum(largest) if copies else 0
    root = gathered = 0
    for part in stage_parts(inventory, setup) if setup.stage == 3 else ():  # the dense stage's units, the experts'
        units = stage3_units(part.inventory, part.setup, stage_buckets(part.inventory, part.setup))
        kept = {u.index for u in persistent_units(units, part.setup)}
        part_root = p * units[0].gathered_numel if 0 not in kept else 0
        blocks = sorted((u.gathered_numel for u in units[1:] if u.index not in kept), reverse=True)[:2]
        root += part_root
        gathered += part_root + p * sum(blocks)
    return {"forward": gathered, "head": gathered, "blocks": gathered + staging,
            "tail": root + staging + grads_kept}


def predicted_peak(record: dict, setup: EngineSetup, inventory: ParamInventory, calibration: Calibration | None,
                   activations: int | None) -> tuple[int | None, str]:
    states = engine_states(inventory, setup)
    after_step, after_backward = sum(states.after_step.values()), sum(states.after_backward.values())
    kept = after_backward - after_step  # what backward makes and the step lets go of: the gradients, hpZ's copies
    if calibration is None:
        if activations is None:
            return None, "no calibration and no shapes"
        return after_backward + activations, "model states after backward + activations (no calibration)"
    b, s, layers = record["micro_batch"], record["seq_len"], record["model"].get("n_layers") or None
    phases = {phase: math.ceil(peak / setup.sequence) for phase, peak in calibration.phase_peaks(b, s, layers).items()}
    extras = engine_extras(inventory, setup, kept)
    # the tail's extras hold `kept`; stages 2-3 make a bucket's gradient shard at its first reduction: none during the
    # head's backward, the last block's bucket during the blocks' peak (See [Note: gradients live from a window's
    # first backward to its step] in the engine)
    first_shard = max((b.shard_numel for b in engine_buckets(inventory, setup)), default=0)
    first_shard *= BYTES_PER_ELEMENT[setup.reduce_dtype]
    in_backward = {"head": states.gradient_buffer, "blocks": states.gradient_buffer} if setup.stage < 2 else \
        {"head": 0, "blocks": first_shard}
    peaks = {phase: phases[phase] + extras.get(phase, 0) + in_backward.get(phase, 0) for phase in phases} | \
        {"step": kept}
    phase = max(peaks, key=peaks.get)
    return after_step + peaks[phase], f"model states + the {phase} phase's peak"


def predicted_seconds(record: dict, setup: EngineSetup, inventory: ParamInventory, device: DeviceProfile | None,
                      mfu: float, comm: dict) -> dict[str, float | None]:
    spec = model_spec(record)
    out: dict[str, float | None] = {"forward": None, "backward": None, "step": None, "communication": None}
    if device is None:
        return out
    if spec is not None and spec.architecture is not None:
        forward, backward = flops_per_token(spec, param_counts(spec, Trainable()), _training(record, setup))
        tokens = record["micro_batch"] * record["seq_len"] * setup.grad_accum
        rate = device.flops(setup.precision) * mfu
        out["forward"], out["backward"] = forward * tokens / rate, backward * tokens / rate
    n = setup.world
    steps = {"all_reduce": 2 * (n - 1)}
    wire = wire_bytes(comm, setup)
    seconds = {k: wire[k] / device.link_bandwidth + e["calls"] * steps.get(k, n - 1) * device.link_latency
               for k, e in per_kind(comm).items()}
    out["communication"] = sum(seconds.values())
    per_element = device.optimizer_seconds_per_element.get(optimizer_key(setup.optimizer, setup.fused_optimizer))
    if per_element is not None:
        # the optimizer on the owned elements; the norm reads their gradients and publishing writes the
        # compute copy (memory-bound); then the step's own collectives: the norm and, at stages 1-2, the
        # all-gather of the updated parameters (stage 3 gathers in the next forward)
        owned = sum(b.shard_numel for b in engine_buckets(inventory, setup))
        touched = owned * (BYTES_PER_ELEMENT[setup.reduce_dtype] + BYTES_PER_ELEMENT[setup.precision])
        after = seconds.get("all_gather", 0.0) if setup.stage in (1, 2) else 0.0
        norm = (seconds.get("all_reduce", 0.0) / max(1, comm.get("all_reduce", {}).get("calls", 1)) if setup.stage
                else 0.0)
        out["step"] = owned * per_element + touched / device.memory_bandwidth + after + norm
    if out["forward"] is not None and setup.backend == "gloo":
        # gloo runs collectives on the CPU cores that compute, so on a CPU nothing overlaps: the gradient
        # reductions lengthen backward, stage 3's gathers forward and backward (about half each)
        reduce = sum(v for k, v in seconds.items()
                     if k in ("reduce_scatter", "all_reduce")) - (norm if setup.stage else 0)
        gathers = seconds.get("all_gather", 0.0) if setup.stage == 3 else 0.0
        out["forward"] += gathers / 2
        out["backward"] += reduce + gathers / 2
    return out


def calibrated_mfu(calibration: Calibration | None, spec: ModelSpec | None, device: DeviceProfile | None,
                   precision: str) -> float | None:
    """Achieved / peak FLOP/s of the calibration's timed forward and backward (its largest shape)."""
    timed = [s for s in (calibration.samples if calibration else ()) if "forward_s" in s]
    if not timed or spec is None or spec.architecture is None or device is None:
        return None
    sample = timed[-1]
    # CPU time where measured: it leaves out waiting for a core another process holds
    seconds = sample.get("forward_cpu_s", sample["forward_s"]) + sample.get("backward_cpu_s", sample["backward_s"])
    arch = replace(spec.architecture, n_layers=calibration.n_layers)
    small = replace(spec, architecture=arch, total_params=arch.total_params())
    training = Training(precision=precision, seq_len=sample["seq"], micro_batch=sample["batch"])
    forward, backward = flops_per_token(small, param_counts(small, Trainable()), training)
    return (forward + backward) * sample["batch"] * sample["seq"] / seconds / device.flops(precision)


def check_rows(record: dict, calibration: Calibration | None = None, device: DeviceProfile | None = None,
               mfu: float | None = None, slack: float | None = None) -> list[Row]:
    """Predicted beside measured for every category a record holds. See [Note: predicting a recorded run]."""
    setup = EngineSetup(**record["setup"])
    inventory = ParamInventory.from_dict(record["inventory"])
    measured = record["measured"]
    states = engine_states(inventory, setup)
    rows = [Row(name, "bytes", states.after_backward[name], measured["after_backward"][name], "after backward")
            for name in STATE_CATEGORIES]
    rows += [Row(f"{name}_after_step", "bytes", states.after_step[name], measured["after_step"][name])
             for name in STATE_CATEGORIES]
    activations, how = predicted_activations(record, setup, calibration)
    rows.append(Row("activations", "bytes", activations, measured["activations"], how))
    peak, how = predicted_peak(record, setup, inventory, calibration, activations)
    rows.append(Row("peak_allocated", "bytes", peak, measured["peak_allocated"], how))
    resident = (calibration.resident_bytes if calibration else 0) or (device.resident_bytes if device else 0)
    slack = slack if slack is not None else (calibration.allocator_slack if calibration else 0.0)
    kept = sum(states.after_step.values()) + states.gradient_buffer  # a few large tensors: no slack on them
    fixed = calibration.resident_fixed_bytes if calibration else 0
    total = resident + kept + fixed + (peak - kept) * (1 + slack) if peak is not None and resident else None
    rows.append(Row("peak_total", "bytes", total, measured["peak_resident"],
                    f"resident peak: framework {resident / 2**20:.0f} MiB + model states + {fixed / 2**20:.0f} MiB "
                    f"+ the step's allocations x {1 + slack:.2f}"))
    comm = engine_comm(inventory, setup, rank=0)  # the record holds rank 0's (See [Note: what a record measures])
    for kind in sorted(set(comm) | set(measured["comm_per_step"])):  # per kind, per "<group>.<kind>", "cross_node"
        plan, run = comm.get(kind, {}), measured["comm_per_step"].get(kind, {})
        keys = ("bytes",) if kind == "cross_node" else ("calls", "elements", "bytes")
        rows += [Row(f"{kind}.{key}", "bytes" if key == "bytes" else "count", plan.get(key, 0), run.get(key, 0))
                 for key in keys]
    rows.append(Row("wire_bytes", "bytes", sum(wire_bytes(comm, setup).values()),
                    sum(wire_bytes(measured["comm_per_step"], setup).values()), "sent per rank on a ring"))
    rows += exchange_rows(record, setup)
    return rows + time_rows(record, setup, inventory, comm, calibration, device, mfu)


def exchange_rows(record: dict, setup: EngineSetup) -> list[Row]:
    """The split experts' all-to-alls, where the record measured them (a rank's mean), beside the plan's: dispatch
    and combine per MoE layer, forward and backward (See [Note: the expert exchange in the plan] in comms.py)."""
    measured = record["measured"].get("all_to_all")
    if measured is None:
        return []
    spec = model_spec(record)
    training = _training(record, setup)
    planned = None
    if spec is not None and spec.architecture is not None and spec.architecture.experts is not None:
        calls, elements = expert_exchange_size(spec, training)
        planned = {"calls": calls, "elements": elements, "bytes": elements * training.act_bytes}
    note = "the expert exchange, mean over ranks" + ("" if planned else "; no MoE shapes to plan it from")
    return [Row(f"all_to_all.{key}", "bytes" if key == "bytes" else "count", planned[key] if planned else None,
                measured[key], note) for key in ("calls", "elements", "bytes")]


def time_rows(record: dict, setup: EngineSetup, inventory: ParamInventory, comm: dict,
              calibration: Calibration | None, device: DeviceProfile | None, mfu: float | None) -> list[Row]:
    """Each phase's seconds: on the line through timed copies of the model when the calibration has them, else
    from FLOPs, the device and the alpha-beta model. See [Note: timing copies] in zerokit/profiling/resident.py."""
    measured = record["measured"]
    line = copy_line(calibration, record["model"]["n_layers"])
    if line is not None:
        wall, cpu = line
        note = f"line through copies of {' and '.join(str(c['blocks']) for c in calibration.copy_seconds)} blocks"
        notes = dict.fromkeys(PHASE_TIMES, note)
        replayed = [copy["seconds"]["run_communication"] for copy in calibration.copy_seconds
                    if "run_communication" in copy["seconds"]]
        if replayed:  # the run's own collectives (as the plan counts them), replayed on the copies' ranks
            wall["communication"] = min(replayed)  # the fastest, as replay_collectives takes within one copy
            notes["communication"] = "the run's collectives replayed on the copies' ranks"
        rows = [Row(f"time.{phase}", "seconds", wall.get(phase), measured["seconds"].get(phase), notes[phase])
                for phase in PHASE_TIMES]
        return rows + [Row(f"cpu_time.{phase}", "seconds", cpu.get(phase), value, note + ", CPU seconds")
                       for phase, value in measured.get("cpu_seconds", {}).items()]
    used_mfu = mfu or calibrated_mfu(calibration, model_spec(record), device, setup.precision) or 0.4
    seconds = predicted_seconds(record, setup, inventory, device, used_mfu, comm)
    rows = [Row(f"time.{phase}", "seconds", value, measured["seconds"].get(phase),
                f"MFU {used_mfu:.2f}" if phase in ("forward", "backward") else "") for phase, value in seconds.items()]
    # the same prediction against CPU time, steady under load
    return rows + [Row(f"cpu_time.{phase}", "seconds", seconds.get(phase), value, "CPU seconds of the slowest rank")
                   for phase, value in measured.get("cpu_seconds", {}).items()]


def copy_line(calibration: Calibration | None, blocks: int) -> tuple[dict[str, float], dict[str, float]] | None:
    """(wall, CPU) seconds by phase at `blocks` blocks, on the line through the two timed copies; None without
    two copies of different sizes. A slope below zero is the noise of two close points: then flat."""
    copies = sorted(calibration.copy_seconds, key=lambda c: c["blocks"]) if calibration else []
    if len(copies) < 2 or copies[0]["blocks"] == copies[-1]["blocks"]:
        return None
    small, large = copies[0], copies[-1]

    def at(key: str) -> dict[str, float]:
        per_block = {phase: max(0.0, (large[key][phase] - small[key][phase]) / (large["blocks"] - small["blocks"]))
                     for phase in large[key] if phase in small[key]}
        return {phase: large[key][phase] + slope * (blocks - large["blocks"]) for phase, slope in per_block.items()}

    return at("seconds"), at("cpu_seconds")


PHASE_TIMES = ("forward", "backward", "step", "communication")


def format_rows(rows: list[Row]) -> list[str]:
    """A fixed-width table: category, unit, predicted, measured, error."""
    def show(value: float | None, unit: str) -> str:
        if value is None:
            return "-"
        return (f"{value / 2**20:,.2f} MiB" if unit == "bytes" else f"{value:.4f} s" if unit == "seconds"
                else f"{value:,.0f}")

    table = [("category", "predicted", "measured", "error", "how")]
    for row in rows:
        error = "-" if row.error is None else f"{row.error:+.1%}"
        table.append((row.category, show(row.predicted, row.unit), show(row.measured, row.unit), error, row.note))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    return ["  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:4], widths[1:])), r[4]]).rstrip()
            for r in table]
