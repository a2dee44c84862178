"""`plan_report`: the plan for a recorded run's configuration beside what the run measured, row by row
(See [Note: predicting a recorded run] in zerokit/planner/check.py). What `engine.plan_report()` and
`zerokit plan --check RUN` return and print."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from zerokit.planner.calibration import Calibration
from zerokit.planner.check import check_rows, format_rows
from zerokit.planner.device import DeviceProfile
from zerokit.profiling.record import RunRecord, last_record


def _as_dict(record: RunRecord | dict | str | Path) -> dict:
    if isinstance(record, (str, Path)):
        record = RunRecord.load(record)
    return vars(record) if isinstance(record, RunRecord) else record


def calibrate_for_record(record: RunRecord | dict | str | Path, layers: int = 2, resident: bool = True) -> Calibration:
    """Calibrate the recorded run's model (a `layers`-block copy built from its Hugging Face config) and, with
    `resident`, train copies of it at the run's stage, world size and shape: the framework's resident share,
    the allocator's slack and each phase's time (See [Note: measuring allocator slack] and [Note: timing
    copies] in zerokit/profiling/resident.py)."""
    from dataclasses import replace

    from zerokit.profiling.calibrate import calibrate
    from zerokit.profiling.resident import measure_copies

    record = _as_dict(record)
    hf = record["model"].get("hf_config")
    if not hf:
        raise ValueError("the run's model has no Hugging Face config to rebuild it from; calibrate the module "
                         "yourself (zerokit.profiling.calibrate.calibrate(module, ...)) and pass calibration=")
    setup = record["setup"]
    with tempfile.TemporaryDirectory(prefix="zerokit-calibrate-") as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(hf))
        calibration = calibrate(str(path), precision=setup["precision"], layers=layers)
        if resident:
            copies = measure_copies(str(path), record["micro_batch"], record["seq_len"], layers=layers,
                                    world=setup["world"], **copy_targets(record))
            calibration = replace(calibration, resident_bytes=copies.framework, allocator_slack=copies.slack,
                                  resident_fixed_bytes=copies.fixed, copy_seconds=copies.seconds)
    return calibration


def copy_targets(record: dict) -> dict:
    """What copies of a recorded run's model take from it (measure_copies' keywords): its engine config and
    optimizer kind, each parameter's optimizer group, by name, and the step's collectives as the plan counts
    them (exactly), to replay."""
    from zerokit.planner.engine_model import EngineSetup, ParamInventory, engine_comm
    from zerokit.profiling.record import engine_config

    inventory = ParamInventory.from_dict(record["inventory"])
    return {"config": engine_config(record["setup"]), "optimizer": record["setup"]["optimizer"],
            "groups": {entry.name: entry.group for entry in inventory.entries},
            "replay": engine_comm(inventory, EngineSetup(**record["setup"]))}


def plan_report(engine: Any = None, record: RunRecord | dict | str | Path | None = None,
                calibration: Calibration | str | Path | None = None, device: DeviceProfile | str | Path | None = None,
                mfu: float | None = None) -> list[dict]:
    """Rows of {category, unit, predicted_bytes|seconds|count, measured_..., error, note}, one per memory
    category (after backward and after the step), activations, peak_allocated, peak_total (the resident
    peak per rank), each collective kind's calls, elements and bytes, wire bytes, and the times.
    `record`: a RunRecord, its file, or None for the engine's latest (zerokit.profiling.record_run);
    `calibration`: a Calibration or its file, or None to calibrate the run's model now (its Hugging Face
    config, 2 blocks, in this process); `device`: a DeviceProfile or its file, for the times and the
    framework's resident share (peak_total is predicted only when that share is known)."""
    if record is None:
        record = last_record(engine) if engine is not None else None
        if record is None:
            raise ValueError("no run recorded for this engine; call zerokit.profiling.record_run(engine, ...) first")
    record = _as_dict(record)
    if isinstance(calibration, (str, Path)):
        calibration = Calibration.load(calibration)
    elif calibration is None and record["model"].get("hf_config"):
        # in this process only: every rank may be calling this, so nothing is spawned (no slack measured;
        # `zerokit plan --check RUN --calibrate` measures it in fresh processes)
        calibration = calibrate_for_record(record, resident=False)
    if isinstance(device, (str, Path)):
        device = DeviceProfile.load(device)
    return [row.as_dict() for row in check_rows(record, calibration, device, mfu)]


def report_lines(record: RunRecord | dict | str | Path, calibration: Calibration | None,
                 device: DeviceProfile | None, mfu: float | None = None) -> list[str]:
    return format_rows(check_rows(_as_dict(record), calibration, device, mfu))
