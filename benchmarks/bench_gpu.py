"""zerokit stages 0-3 beside plain torch, DDP and FSDP2 on one GPU: what the engine costs per step where there is
nothing to communicate, and its peak GPU memory beside the model states it counts.

    python benchmarks/bench_gpu.py --n-layer 24 --n-embd 1024 --block-size 1024 --batch-size 8 --dtype bf16

One process, the group a plain `python` script gets (on a GPU: one NCCL rank), and bench_stages.py's contenders
and workload (benchmarks/contenders.py, benchmarks/workload.py) with the model and the batches on the device,
one contender after another in the same process. step s: the median wall time of a step (forward, loss,
backward, optimizer step) between two device synchronizations. peak MiB: torch's CUDA high-water mark over what
was allocated before the model was built (None on a CPU, where bench_stages.py reads the RSS instead). states
MiB: the model-state bytes the contender holds after its last step (its own tensors). phases: one more step after
the timed ones, with the bytes allocated after its forward, backward and optimizer step, and the peak within each
(where the high-water mark is reached, and how far above the states it stands). zerokit-2-offload and
zerokit-3-offload put the optimizer (and at stage 3 the parameters) in pinned host memory. Without a GPU it runs on
the CPU, which is only a check that the script works.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/bench_gpu.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.contenders import CONTENDERS, Contender, Trainer, zerokit_trainer
from benchmarks.workload import BenchSettings, make_batch, make_model
from zerokit.comm.process import default_device, ensure_process_group
from zerokit.testing.models import lm_loss

DEFAULT_CONTENDERS = ("single-process", "torch-ddp", "fsdp2", "zerokit-0", "zerokit-1", "zerokit-2", "zerokit-3")
OFFLOADED = [Contender(f"zerokit-{stage}-offload", stage, "zerokit",
                       functools.partial(zerokit_trainer, stage=stage, offload="cpu"))
             for stage in (2, 3)]  # run when asked for by name (--only)
DEFAULT_OUT = Path("bench_results/bench_gpu.json")


def parse_args(argv: list[str] | None) -> tuple[BenchSettings, argparse.Namespace]:
    defaults = BenchSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    for name in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size", "batch_size"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    parser.add_argument("--only", default=",".join(DEFAULT_CONTENDERS), help="contenders, comma-separated")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    settings = BenchSettings(world_size=1, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
                             n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size,
                             vocab_size=args.vocab_size, batch_size=args.batch_size)
    return settings, args


def chosen(names: str) -> list[Contender]:
    known = {contender.name: contender for contender in [*CONTENDERS, *OFFLOADED]}
    unknown = [name for name in names.split(",") if name not in known]
    if unknown:
        raise SystemExit(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[name] for name in names.split(",")]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseMemory:
    """Bytes allocated on the device over a baseline at the end of each phase of a step, and the peak within it
    (torch's high-water mark, reset at each mark); nothing on a CPU."""

    def __init__(self, device: torch.device, baseline: int) -> None:
        self.device, self.baseline, self.marks = device, baseline, {}

    def mark(self, phase: str) -> None:
        if self.device.type != "cuda":
            return
        synchronize(self.device)
        self.marks[phase] = {"allocated": torch.cuda.memory_allocated(self.device) - self.baseline,
                             "peak": torch.cuda.max_memory_allocated(self.device) - self.baseline}
        torch.cuda.reset_peak_memory_stats(self.device)


def build(contender: Contender, settings: BenchSettings, device: torch.device,
          model: torch.nn.Module | None = None) -> Trainer:
    """The contender over `model` (default: a fresh GPT of `settings`): DDP, FSDP2, DeepSpeed and plain torch take it
    on `device`; zerokit places it."""
    model = make_model(settings) if model is None else model
    if not contender.is_zerokit:
        model.to(device)
    return contender.build(model, settings)


def run(contender: Contender, settings: BenchSettings, device: torch.device,
        model: torch.nn.Module | None = None) -> dict:
    """One contender's steps on `device` (over `model`, default a fresh GPT of `settings`); what it leaves behind is
    released before the next one is built."""
    gc.collect()
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if on_gpu else 0
    trainer = build(contender, settings, device, model)
    del model  # the trainer holds what it keeps of it
    seconds, losses = [], []
    for step in range(settings.warmup + settings.steps):
        tokens = make_batch(settings, 0, step).to(device)
        synchronize(device)
        started = time.perf_counter()
        loss = lm_loss(trainer.forward(tokens[:, :-1]), tokens)
        trainer.backward(loss)
        trainer.step()
        synchronize(device)
        if step >= settings.warmup:
            seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
    memory = PhaseMemory(device, before)  # one more step, untimed, in phases
    _phased_step(trainer, make_batch(settings, 0, settings.warmup + settings.steps).to(device), losses, memory)
    result = {"name": contender.name, "stage": contender.stage, "family": contender.family,
              "median_step_seconds": statistics.median(seconds), "step_seconds": seconds, "losses": losses,
              "peak_bytes": max(mark["peak"] for mark in memory.marks.values()) if on_gpu else None,
              "phases": {phase: mark for phase, mark in memory.marks.items() if phase != "before"},
              "state_bytes": trainer.state_bytes()}
    if hasattr(trainer.forward, "close"):  # a zerokit engine: its groups and hooks go now, not at exit
        trainer.forward.close()
    return result


def _phased_step(trainer, tokens: torch.Tensor, losses: list[float], memory: PhaseMemory) -> None:
    """One step with the memory marked before it and after each phase."""
    memory.mark("before")  # the high-water mark of every step so far
    loss = lm_loss(trainer.forward(tokens[:, :-1]), tokens)
    memory.mark("forward")
    trainer.backward(loss)
    memory.mark("backward")
    trainer.step()
    memory.mark("step")
    losses.append(loss.item())


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["name"] == "single-process"), results[0])
    lines = [f"{'contender':<16}{'step s':>9}{'x torch':>9}{'peak MiB':>10}{'states MiB':>12}{'last loss':>11}"]
    for r in results:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        lines.append(f"{r['name']:<16}{r['median_step_seconds']:>9.4f}"
                     f"{r['median_step_seconds'] / base['median_step_seconds']:>9.2f}{peak:>10}"
                     f"{sum(r['state_bytes'].values()) / 2**20:>12.0f}{r['losses'][-1]:>11.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    settings, args = parse_args(argv)
    ensure_process_group()
    device = default_device()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what GPU training runs with; equal for every contender
    results = [run(contender, settings, device) for contender in chosen(args.only)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    numel = sum(p.numel() for p in make_model(settings).parameters())
    print(f"{name}, torch {torch.__version__}, {numel / 1e6:.1f}M parameters, {settings.dtype}, batch "
          f"{settings.batch_size} x {settings.block_size}, {settings.steps} timed steps after {settings.warmup}")
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "torch": torch.__version__, "settings": settings.as_dict(),
                                    "parameters": numel, "results": results}, indent=1))


if __name__ == "__main__":
    main()
