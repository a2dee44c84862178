"""zerokit stages 0-3 beside torch DDP, torch's ZeroRedundancyOptimizer, FSDP2 and DeepSpeed stages 1-3:
step time, peak memory per rank, model-state bytes against the ZeRO formula, bytes communicated, and
the loss.

    python benchmarks/bench_stages.py --world-size 2 --steps 6 --warmup 2

Each contender runs in its own freshly spawned gloo ranks (so each process's peak RSS is its own),
on the same model, initial weights, per-rank data, optimizer and bucket size. Peers that are not
installed are skipped with a line saying how to install them. What is measured and how:
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/bench_stages.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.contenders import CONTENDERS, Contender
from benchmarks.harness import run_rank
from benchmarks.report import check_losses, compare, format_report, summarize
from benchmarks.workload import DTYPES, OPTIMIZERS, BenchSettings
from zerokit.testing.spawn import spawn

DEFAULT_OUT = Path("bench_results/bench_stages.json")


def parse_args(argv: list[str] | None) -> tuple[BenchSettings, argparse.Namespace]:
    defaults = BenchSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--world-size", type=int, default=defaults.world_size)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps first")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype,
                        help="fp32, or bf16 mixed precision (fp32 master weights and Adam state)")
    parser.add_argument("--n-layer", type=int, default=defaults.n_layer)
    parser.add_argument("--n-embd", type=int, default=defaults.n_embd)
    parser.add_argument("--n-head", type=int, default=defaults.n_head)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=defaults.bucket_bytes / 2**20,
                        help="gradient bucket size in MiB, for every contender that has the knob")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer,
                        help="adamw, or muon: torch Muon on the matrices beside AdamW on the rest (DeepSpeed: its Muon)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--rounds", type=int, default=2,
                        help="run every contender this many times, alternating the order; timed steps are pooled")
    parser.add_argument("--only", default="", help="comma-separated contenders to run; all: "
                        + ", ".join(c.name for c in CONTENDERS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON of raw numbers")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be >= 1")
    settings = BenchSettings(
        world_size=args.world_size, steps=args.steps, warmup=args.warmup, dtype=args.dtype, n_layer=args.n_layer,
        n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size, vocab_size=args.vocab_size,
        batch_size=args.batch_size, bucket_bytes=int(args.bucket_mb * 2**20), lr=args.lr, seed=args.seed,
        optimizer=args.optimizer)
    return settings, args


def select(only: str) -> list[Contender]:
    if not only:
        return list(CONTENDERS)
    names = [name.strip() for name in only.split(",") if name.strip()]
    known = {c.name: c for c in CONTENDERS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[name] for name in names]


def environment() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import importlib.metadata as metadata
        versions["deepspeed"] = metadata.version("deepspeed")
    except Exception:  # not installed: PackageNotFoundError
        versions["deepspeed"] = None
    return {**versions, "cpus": os.cpu_count(), "platform": platform.platform(),
            "load_average_at_start": os.getloadavg()}


def run_rounds(contenders: list[Contender], settings: BenchSettings, rounds: int) -> tuple[dict, dict, dict]:
    """Every contender `rounds` times in fresh processes, in order, then in reverse order, and so on
    (A B C, C B A, ...), so that a drift in the machine's load weighs on all contenders alike."""
    results: dict[str, list[list[dict]]] = {c.name: [] for c in contenders}
    walls: dict[str, list[float]] = {c.name: [] for c in contenders}
    failed: dict[str, str] = {}
    for round_index in range(rounds):
        sequence = contenders if round_index % 2 == 0 else contenders[::-1]
        for contender in (c for c in sequence if c.name not in failed):
            processes = 1 if contender.single_process else settings.world_size
            print(f"round {round_index + 1}/{rounds}: {contender.name} on {processes} ranks ...", end=" ", flush=True)
            load_before, spawned = os.getloadavg()[0], time.perf_counter()
            try:
                ranks = spawn(run_rank, processes, contender, settings)
            except RuntimeError as error:
                failed[contender.name] = str(error)
                print(f"FAILED\n{error}", flush=True)
                continue
            walls[contender.name].append(time.perf_counter() - spawned)
            results[contender.name].append(ranks)
            print(f"median step {statistics.median(ranks[0]['step_seconds']):.3f} s ({walls[contender.name][-1]:.0f} s "
                  f"with start-up; 1-min load average {load_before:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    return results, walls, failed


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    # DeepSpeed on a machine without a GPU: say so rather than let it probe (and warn in every rank).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    started = time.perf_counter()
    env = environment()
    runnable, skipped = [], {}
    for contender in select(args.only):
        reason = contender.why_skipped(settings.dtype) or contender.why_not_optimizer(settings.optimizer)
        if reason is None:
            runnable.append(contender)
        else:
            skipped[contender.name] = reason
            print(f"skip {contender.name}: {reason}", flush=True)
    results, walls, failed = run_rounds(runnable, settings, args.rounds)
    summaries = {c.name: summarize(c, results[c.name], settings, walls[c.name])
                 for c in runnable if c.name not in failed}
    notes = {c.name: c.note for c in runnable if c.note and c.name in summaries}
    comparisons = compare(summaries)
    losses = check_losses(summaries, settings.dtype)
    print()
    print(format_report(settings, summaries, comparisons, losses, skipped, notes))
    for name, error in failed.items():
        print(f"\nFAILED {name}: {error.strip().splitlines()[-1] if error.strip() else ''}")
    total = time.perf_counter() - started
    env["load_average_at_end"] = os.getloadavg()
    result = {"settings": settings.as_dict(), "rounds": args.rounds, "environment": env, "contenders": summaries,
              "comparisons": comparisons, "loss_check": losses, "skipped": skipped, "failed": failed,
              "total_seconds": total}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nraw numbers: {args.out}; total {total:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
