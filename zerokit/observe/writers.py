"""Training metrics written where DeepSpeed's monitors write them (csv_monitor, tensorboard, wandb), on rank 0.

An event is (name, value, x) with DeepSpeed's names ("Train/Samples/lr", ...) and x the number of samples
trained on so far, as DeepSpeed plots them, so dashboards built on DeepSpeed's files read zerokit's too.
csv_monitor writes one file per event, `<output_path>/<job_name>/<name with / as _>.csv`, with the header
`step,<last part of the name>`, as deepspeed/monitor/csv_monitor.py does.
"""

from __future__ import annotations

import csv
import importlib
import os
from pathlib import Path
from typing import Any, Protocol

from zerokit._support.extras import installed, monitor_missing
from zerokit.config.settings import ObserveSettings

Event = tuple[str, float, int]


class EventWriter(Protocol):
    def write(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def require(package: str, key: str) -> Any:
    """Import an optional package a monitor needs, or say in one line which one to install."""
    if not installed(package):
        raise ValueError(monitor_missing(package, key))
    return importlib.import_module(package)


class CsvWriter:
    def __init__(self, output_path: str, job_name: str) -> None:
        self.directory = Path(output_path) / job_name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.started: set[str] = set()

    def write(self, events: list[Event]) -> None:
        for name, value, x in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(self.directory / f"{filename}.csv", "a+", newline="") as file:
                writer = csv.writer(file)
                if filename not in self.started:  # a new run appends to an old file with its own header, as DeepSpeed
                    self.started.add(filename)
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([x, value])

    def close(self) -> None:
        pass


class TensorboardWriter:
    def __init__(self, output_path: str, job_name: str) -> None:
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(output_path, job_name))

    def write(self, events: list[Event]) -> None:
        for name, value, x in events:
            self.writer.add_scalar(name, value, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        self.wandb = require("wandb", "wandb")
        self.wandb.init(project=project, group=group, entity=team)

    def write(self, events: list[Event]) -> None:
        for name, value, x in events:
            self.wandb.log({name: value}, step=x)

    def close(self) -> None:
        self.wandb.finish()


def writers_for(part: ObserveSettings) -> list[EventWriter]:
    """The monitors the config turns on (call on rank 0 only)."""
    writers: list[EventWriter] = []
    if part.csv_monitor.enabled:
        writers.append(CsvWriter(part.csv_monitor.output_path, part.csv_monitor.job_name))
    if part.tensorboard.enabled:
        writers.append(TensorboardWriter(part.tensorboard.output_path, part.tensorboard.job_name))
    if part.wandb.enabled:
        writers.append(WandbWriter(part.wandb.project, part.wandb.group, part.wandb.team))
    return writers


__all__ = ["Event", "EventWriter", "CsvWriter", "TensorboardWriter", "WandbWriter", "writers_for", "require"]
