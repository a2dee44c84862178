"""The GPU check (issue 34): one command that, on one GPU, measures what CPU ranks cannot show and writes one
results file.

    python benchmarks/gpu_check.py                      # or: make gpu-check
    python benchmarks/gpu_check.py --budget 420 --out benchmarks/results/gpu-2026-11-27.json

Its parts, in order, each recorded as it ends (a part that fails records its error and the next one runs; the
file is rewritten after each part, so a check cut short still leaves what it measured):
1. contenders: benchmarks/bench_gpu.py's steps for plain torch, FSDP2, zerokit stages 0-3 and zerokit with the
   optimizer (stage 2) or everything (stage 3) offloaded to pinned host memory, on one GPT, bf16: peak MiB (torch's
   high-water mark over what was allocated before the model), median step seconds, the model states each holds,
   and the memory after each phase of a step.
2. peak: where each of plain torch, FSDP2, zerokit-2 and zerokit-3 stands at its peak, from torch's allocator history of
   one step (the live bytes at the high-water mark, by the first frame of the call that allocated them).
3. teardown: seconds to close an engine and to destroy the one-rank NCCL group, in a fresh process, after 1 and
   after 10 engines, beside plain torch's destroy; a stack dump after 15 s says where a slow one waits.
4. throughput: a 1.1B Llama (benchmarks/llama.py), bf16, one GPU, under FSDP2, zerokit stage 3 and DeepSpeed stage 3
   where it imports: tokens/s, MFU against the card's dense bf16 peak, peak MiB.
5. tests: tests/test_cuda.py under pytest (the parity matrix on CUDA, offload read from the allocator, a GPU
   checkpoint read without one, the planner against a recorded run), in the time left.

The file: {"card", "torch", "date", "settings", "contenders": {NAME: {"peak_mib", "step_s", "states_mib",
"phases"}}, "peak": {...}, "teardown": {...}, "tests": {...}, "parts": {PART: seconds or error}} with NAME in
plain-torch, fsdp2, zerokit-0 ... zerokit-3, zerokit-2-offload, zerokit-3-offload, and deepspeed-2 and deepspeed-3
where DeepSpeed imports. Without a GPU it runs
on the CPU with the model given (tests/test_benchmarks.py runs a tiny one there so that it keeps working);
the figures that need the GPU are then None.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as `python benchmarks/gpu_check.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import bench_gpu
from benchmarks.contenders import Contender
from benchmarks.llama import Llama, LlamaConfig, flops_per_token
from benchmarks.workload import BenchSettings, make_batch
from zerokit.comm.process import default_device, ensure_process_group
from zerokit.testing.models import lm_loss

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = {"plain-torch": "single-process", "fsdp2": "fsdp2", "zerokit-0": "zerokit-0", "zerokit-1": "zerokit-1",
              "zerokit-2": "zerokit-2", "zerokit-3": "zerokit-3", "zerokit-2-offload": "zerokit-2-offload",
              "zerokit-3-offload": "zerokit-3-offload", "deepspeed-2": "deepspeed-2",
              "deepspeed-3": "deepspeed-3"}  # the results file's names -> bench_gpu's
AT_PEAK = ("plain-torch", "fsdp2", "zerokit-2", "zerokit-3")
MIB = 2 ** 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                        f"gpu-{datetime.date.today().isoformat()}.json")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check; the tests get "
                        "what the other parts leave")
    parser.add_argument("--parts", default="contenders,peak,teardown,throughput,tests")
    parser.add_argument("--throughput-model", choices=sorted(LLAMAS), default="1b", help="the Llama's shape (tiny: "
                        "a check that the part runs)")
    parser.add_argument("--throughput-seq", type=int, default=2048, help="the Llama's sequence length")
    parser.add_argument("--throughput-batch", type=int, default=4, help="the Llama's sequences per step")
    parser.add_argument("--throughput-steps", type=int, default=8, help="the Llama's timed steps")
    parser.add_argument("--only", default=",".join(name for name, _ in _available(tuple(CONTENDERS))),
                        help="contenders, comma-separated (default: every one whose package imports here)")
    for name, default in (("n_layer", 24), ("n_embd", 1024), ("n_head", 16), ("block_size", 1024),
                          ("vocab_size", 32768), ("batch_size", 8), ("steps", 5), ("warmup", 2)):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    return parser.parse_args(argv)


def settings_of(args: argparse.Namespace) -> BenchSettings:
    return BenchSettings(world_size=1, steps=args.steps, warmup=args.warmup, dtype="bf16", n_layer=args.n_layer,
                         n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size,
                         vocab_size=args.vocab_size, batch_size=args.batch_size)


# --- 1. contenders ------------------------------------------------------------------------------------------

def chosen(names: list[str]) -> list[tuple[str, Contender]]:
    """The results file's names with bench_gpu's contenders."""
    return list(zip(names, bench_gpu.chosen(",".join(CONTENDERS[name] for name in names))))


def contenders(names: list[str], settings: BenchSettings, device: torch.device) -> dict[str, dict]:
    rows = {}
    for name, contender in chosen(names):
        if contender.prepare is not None:  # DeepSpeed adopts the process group
            contender.prepare()
        result = bench_gpu.run(contender, settings, device)
        rows[name] = {"peak_mib": None if result["peak_bytes"] is None else result["peak_bytes"] / MIB,
                      "step_s": result["median_step_seconds"],
                      "states_mib": sum(result["state_bytes"].values()) / MIB,
                      "phases_mib": {phase: {key: value / MIB for key, value in mark.items()}
                                     for phase, mark in result["phases"].items()},
                      "last_loss": result["losses"][-1]}
    return rows


# --- 2. where the peak is -----------------------------------------------------------------------------------

def live_at_peak(trace: list[dict], baseline: int, top: int = 12) -> dict[str, Any]:
    """From an allocator trace (torch.cuda.memory._snapshot()["device_traces"][device]): the live bytes at the
    high-water mark, over `baseline` (allocated when the trace began), by the first frame of the allocating call
    that is not torch's own; `top` sites, the rest summed."""
    live: dict[int, tuple[int, str]] = {}  # address -> (bytes, site)
    bytes_live = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], site_of(event.get("frames", [])))
            bytes_live += event["size"]
            if bytes_live > peak:
                peak, at_peak = bytes_live, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            bytes_live -= live.pop(event["addr"])[0]
    by_site = Counter()
    for size, site in at_peak.values():
        by_site[site] += size
    ranked = by_site.most_common()
    sites = {site: size / MIB for site, size in ranked[:top]}
    if len(ranked) > top:
        sites["(the rest)"] = sum(size for _, size in ranked[top:]) / MIB
    return {"peak_over_baseline_mib": peak / MIB, "baseline_mib": baseline / MIB, "sites_mib": sites}


def site_of(frames: list[dict]) -> str:
    """The first Python frame outside torch, the installed packages and the standard library (the model's or the
    engine's code), else the first Python frame: where a tensor was asked for."""
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name and "/lib/python3" not in name:
            return f"{Path(name).name}:{frame.get('line')} {frame.get('name')}"
    for frame in frames:
        if frame.get("filename", "").endswith(".py"):
            return f"{Path(frame['filename']).name}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame)"


def peaks(names: list[str], settings: BenchSettings, device: torch.device) -> dict[str, dict]:
    """One step of each contender under torch's allocator history, after the steps that fill the optimizer."""
    if device.type != "cuda":
        return {}
    out = {}
    for name, contender in chosen(names):
        trainer = bench_gpu.build(contender, settings, device)
        for step in range(2):
            if step == 1:
                torch.cuda.synchronize()
                baseline = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
            tokens = make_batch(settings, 0, step).to(device)
            trainer.backward(lm_loss(trainer.forward(tokens[:, :-1]), tokens))
            trainer.step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        out[name] = live_at_peak(snapshot["device_traces"][device.index or 0], baseline)
        if hasattr(trainer.forward, "close"):
            trainer.forward.close()
        del trainer, snapshot
        torch.cuda.empty_cache()
    return out


def plain_environment() -> dict[str, str]:
    """This process's environment without the launcher variables a contender set (DeepSpeed's RANK, MASTER_PORT,
    ...): a child given them would start its group on this process's port."""
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {name: value for name, value in os.environ.items() if name not in launcher}


# --- 3. teardown --------------------------------------------------------------------------------------------

TEARDOWN = r"""
import faulthandler, json, sys, time
faulthandler.dump_traceback_later(15, repeat=False)  # a slow teardown: where every thread waits, on stderr
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import zerokit
from zerokit.comm.process import ensure_process_group
started = time.perf_counter()
ensure_process_group()
figures = {{"backend": dist.get_backend(), "init_s": time.perf_counter() - started, "close_s": []}}
device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
tensor = torch.ones(1024, device=device)
dist.all_reduce(tensor)
for _ in range({engines}):  # engines made and closed one after another, as a test module does
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(8)])
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters()),
                                {{"zero_optimization": {{"stage": 3}}, "bf16": {{"enabled": True}}}})
    for _ in range(3):
        engine.backward(engine(torch.randn(8, 1024, device=device, dtype=torch.bfloat16)).float().square().mean())
        engine.step()
    started = time.perf_counter()
    engine.close()
    figures["close_s"].append(time.perf_counter() - started)
started = time.perf_counter()
dist.destroy_process_group()
figures["destroy_s"] = time.perf_counter() - started
print(json.dumps(figures))
"""


def teardown(timeout: float, engine_counts: tuple[int, ...] = (0, 1, 10)) -> dict[str, Any]:
    """The default group destroyed after one all-reduce and after each count of zerokit engines (stage 3, bf16,
    three steps each) made and closed: 0 is plain torch."""
    out = {}
    for engines in engine_counts:
        name = "plain-torch" if engines == 0 else "zerokit-3" + (f" x{engines}" if engines > 1 else "")
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", TEARDOWN.format(root=str(ROOT), engines=engines)],
                              capture_output=True, text=True, timeout=timeout, env=plain_environment())
        figures = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
            {"error": done.stderr[-2000:]}
        figures["process_s"] = time.perf_counter() - started
        if "Thread 0x" in done.stderr:  # faulthandler's dump: the process ran over 15 s
            figures["stacks_after_15s"] = done.stderr[-6000:]
        out[name] = figures
    return out


# --- 4. throughput ------------------------------------------------------------------------------------------

THROUGHPUT = ("fsdp2", "zerokit-3", "deepspeed-3")
LLAMAS = {"1b": LlamaConfig(), "tiny": LlamaConfig(vocab_size=64, hidden=32, n_layer=2, n_head=4, n_kv_head=2,
                                                      mlp_hidden=64)}
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bf16, the vendors' data sheets


def throughput(settings: BenchSettings, device: torch.device, names: list[str], config: LlamaConfig, seq_len: int,
               batch_size: int, steps: int) -> dict[str, Any]:
    """benchmarks/llama.py's Llama (1.1B by default), bf16, on one GPU under each of FSDP2, zerokit stage 3 and
    DeepSpeed stage 3 that `names` (the check's --only) holds and that imports: tokens/s over `steps` timed steps after
    3, MFU against the card's dense bf16 peak, and peak MiB. Every contender starts from the same weights and sees the
    same batches."""
    shape = BenchSettings(world_size=1, steps=steps, warmup=3, dtype="bf16", block_size=seq_len + 1,
                          vocab_size=config.vocab_size, batch_size=batch_size, bucket_bytes=settings.bucket_bytes)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = next((tflops for name, tflops in PEAK_TFLOPS.items() if name in card), None)
    out: dict[str, Any] = {"model": f"benchmarks/llama.py {config}", "seq_len": seq_len, "batch_size": batch_size,
                           "peak_tflops": peak, "contenders": {}}
    for name, contender in _available(tuple(name for name in THROUGHPUT if name in names)):
        if contender.prepare is not None:  # DeepSpeed adopts the process group
            contender.prepare()
        torch.manual_seed(shape.seed)
        model = Llama(config)
        out["parameters"] = sum(p.numel() for p in model.parameters())
        flops = flops_per_token(model, seq_len)
        try:
            result = bench_gpu.run(contender, shape, device, model=model)
        except Exception as error:  # recorded: the next contender runs
            out["contenders"][name] = {"error": f"{type(error).__name__}: {error}"[:1000]}
            continue
        tokens_per_s = batch_size * seq_len / result["median_step_seconds"]
        out["contenders"][name] = {
            "step_s": result["median_step_seconds"], "tokens_per_s": tokens_per_s,
            "mfu": None if peak is None else tokens_per_s * flops / (peak * 1e12),
            "peak_mib": None if result["peak_bytes"] is None else result["peak_bytes"] / MIB,
            "losses": result["losses"]}
        del model, result
    return out


def _available(names: tuple[str, ...]) -> list[tuple[str, Contender]]:
    """Those of `names` (the results file's) whose package imports here (DeepSpeed is not on every GPU image)."""
    return [(name, contender) for name, contender in chosen(list(names)) if contender.why_skipped("bf16") is None]


# --- 5. the CUDA tests --------------------------------------------------------------------------------------

def cuda_tests(timeout: float, junit: Path) -> dict[str, Any]:
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "--durations=8", "-p", "no:cacheprovider",
               f"--junitxml={junit}", str(ROOT / "tests" / "test_cuda.py")]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=plain_environment())
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output, status = (expired.stdout or b"").decode(errors="replace"), f"stopped after {timeout:.0f} s"
    counts = {kind: int(number) for number, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", output)}
    failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"status": status, "counts": counts, "failures": failures, "seconds": time.perf_counter() - started,
            "tail": output[-4000:]}


# --- the check ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    ensure_process_group()
    device = default_device()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what GPU training runs with; equal for every contender
    settings = settings_of(args)
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(CONTENDERS)}")
    report: dict[str, Any] = {
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU", "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "settings": settings.as_dict(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]), "parts": {}}
    left = lambda: args.budget - (time.perf_counter() - started)  # noqa: E731
    parts: dict[str, Callable[[], Any]] = {
        "contenders": lambda: contenders(names, settings, device),
        "peak": lambda: peaks([name for name in AT_PEAK if name in names], settings, device),
        "teardown": lambda: teardown(timeout=max(30.0, min(120.0, left() - 60))),
        "tests": lambda: cuda_tests(timeout=max(30.0, left() - 10), junit=args.out.with_suffix(".junit.xml")),
        "throughput": lambda: throughput(settings, device, names, LLAMAS[args.throughput_model], args.throughput_seq,
                                         args.throughput_batch, args.throughput_steps),
    }
    for part in [part for part in args.parts.split(",") if part]:
        part_started = time.perf_counter()
        try:
            report[part] = parts[part]()
            report["parts"][part] = round(time.perf_counter() - part_started, 1)
        except Exception as error:  # recorded, and the next part runs: a cut-short check still says what it saw
            report["parts"][part] = f"{type(error).__name__}: {error}"[:2000]
        print(f"gpu_check: {part}: {report['parts'][part]}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(summary(report))
    return report


def summary(report: dict[str, Any]) -> str:
    lines = [f"{report['card']}, torch {report['torch']}"]
    for name, row in report.get("contenders", {}).items():
        peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.0f}"
        lines.append(f"{name:<20} peak MiB {peak:>8}  step s {row['step_s']:.4f}  states MiB {row['states_mib']:.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
