"""DeepSpeed's flops_profiler: the FLOPs one optimizer step computes, measured with torch.utils.flop_counter.

At optimizer step `profile_step` (counted from 0, as DeepSpeed's global_steps: profile_step 1 is the second
step), rank 0 counts the FLOPs of every forward of that step's micro-steps, module by module, and of every
backward in total (torch's counter attributes backward FLOPs to modules only when it also saw their forward),
then reports them with the step's wall time at the step's end. It counts what ran: recomputation under
activation checkpointing lands in the backward, so `recompute_fwd_factor`, DeepSpeed's estimate of that
share, is not needed to get it right. Only operations torch has a FLOP formula for are counted (matrix
products, convolutions, attention); elementwise work is not, as in DeepSpeed's profiler.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from zerokit.config.dsconfig.blocks import FlopsProfiler


def _counter() -> Any:
    """torch's FlopCounterMode, imported when a step is profiled: torch.utils.flop_counter brings sympy, which every
    rank would otherwise import at start-up and tear down at exit (See dtensor_types in parallel/tensor/torch_tp.py)."""
    from torch.utils.flop_counter import FlopCounterMode
    return FlopCounterMode(display=False, depth=None)


class FlopsProfile:
    def __init__(self, spec: FlopsProfiler, trainable_numel: int) -> None:
        self.spec = spec
        self.trainable_numel = trainable_numel
        self.forward: dict[str, int] = defaultdict(int)  # module name (root's class first) -> forward FLOPs
        self.backward = 0
        self.micro_steps = 0
        self.started: float | None = None
        self.report: list[str] = []  # the last report's lines

    def active(self, completed_steps: int) -> bool:
        return completed_steps == self.spec.profile_step

    @contextmanager
    def forward_phase(self, completed_steps: int) -> Iterator[None]:
        if not self.active(completed_steps):
            yield
            return
        if self.started is None:
            self.started = time.perf_counter()
        mode = _counter()
        with mode:
            yield
        for name, counts in mode.get_flop_counts().items():
            self.forward[name] += sum(counts.values())
        self.micro_steps += 1

    @contextmanager
    def backward_phase(self, completed_steps: int) -> Iterator[None]:
        if not self.active(completed_steps):
            yield
            return
        mode = _counter()
        with mode:
            yield
        self.backward += mode.get_total_flops()

    def finish(self, step: int) -> list[str]:
        """The report of the profiled step (log lines), written to output_file when one is set."""
        seconds = time.perf_counter() - (self.started or time.perf_counter())
        forward = self.forward.get("Global", 0)
        total = forward + self.backward
        lines = [f"flops profiler, step {step} (rank 0, {self.micro_steps} micro-steps, {self.trainable_numel:,} "
                 f"trainable parameters): forward {_flops(forward)}, backward {_flops(self.backward)}, total "
                 f"{_flops(total)} in {seconds:.3f} s ({_flops(total / seconds if seconds > 0 else 0.0)}/s)"]
        lines += self._modules(forward)
        self.report = lines
        if self.spec.output_file:
            Path(self.spec.output_file).write_text("\n".join(lines) + "\n")
        return lines

    def _modules(self, forward: int) -> list[str]:
        """The top_modules modules by forward FLOPs at each depth up to module_depth (-1: every depth); with
        `detailed`, then every module down to that depth, in the order they first ran."""
        by_depth: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for name, flops in self.forward.items():
            if name != "Global" and "." in name:
                path = name.split(".", 1)[1]  # without the root's class name
                by_depth[path.count(".") + 1].append((path, flops))
        deepest = max(by_depth, default=0) if self.spec.module_depth == -1 else self.spec.module_depth
        lines = []
        for depth in range(1, deepest + 1):
            top = sorted(by_depth.get(depth, []), key=lambda item: -item[1])[:self.spec.top_modules]
            if top:
                lines.append(f"  top at depth {depth}: "
                             + ", ".join(f"{path} {_flops(flops)} ({_share(flops, forward)})" for path, flops in top))
        if self.spec.detailed:
            every = [(path, flops) for name, flops in self.forward.items()  # first-run order
                     if "." in name and (path := name.split(".", 1)[1]).count(".") < deepest]
            lines += [f"  {path}: forward {_flops(flops)} ({_share(flops, forward)})" for path, flops in every]
        return lines


def _flops(value: float) -> str:
    for unit, scale in (("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6), ("KFLOPs", 1e3)):
        if value >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value:.0f} FLOPs"


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


__all__ = ["FlopsProfile"]
