"""What zerokit's agreement checks cost (issue 13): the start-up fingerprint, and at stage 3 the unit tables
(See [Note: stage-3 units every rank agrees on] in zerokit/stages/agreement.py).

    python benchmarks/bench_reliability.py                 # 2 gloo ranks, benchmarks/workload.py's GPT
    python benchmarks/bench_reliability.py --world-size 3 --rounds 4
    python benchmarks/bench_reliability.py --n-embd 768 --n-layer 4   # blocks of 7.1M parameters

On the same ranks and engine, each round runs three arms, in alternating order: the checks as zerokit runs
them (each forward and backward follows the order the last one agreed on: one table at its end), the checks
as in a phase that follows no order (the first step; a row beside each unit gather, overlapping it: this
model's blocks are equal) and no checks (the agreement removed from the engine's unit shards, which nothing
else reads); each arm times `--steps` optimizer steps after a barrier, the slowest rank's. The fingerprint is timed as `initialize` runs it (check_at_start: this rank's
checks, the fingerprint, one all-gather), the median of --rounds calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import BenchSettings, make_batch, make_model, make_optimizer  # noqa: E402
from zerokit.testing.models import lm_loss  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402


# checked: as zerokit runs them (one table per forward and per backward); rows: a row beside every unit gather,
# as where no order is followed; unchecked: none
ARMS = ("checked", "unchecked", "rows")


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _steps(engine, settings: BenchSettings, rank: int, first: int, count: int) -> list[float]:
    times = []
    for step in range(first, first + count):
        tokens = make_batch(settings, rank, step)
        dist.barrier()
        started = time.perf_counter()
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()
        times.append(_slowest(time.perf_counter() - started))
    return times


def _settle(agreement) -> None:
    """Check the tables still pending (a prefetch's, announced in the last step), so that none is left un-waited."""
    for unit in list(agreement.pending):
        agreement.confirm(unit)


def _fingerprint_seconds(engine, settings: BenchSettings, rounds: int) -> list[float]:
    """check_at_start on a model and optimizer as the user hands them over (the engine's own optimizers hold
    this rank's shards, which differ by rank)."""
    from zerokit.reliability import check_at_start

    model = make_model(settings)
    optimizer = make_optimizer(model, settings)
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    times = []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        check_at_start(model, optimizers, engine.parts.safeguards, engine.comm, engine.device)
        times.append(_slowest(time.perf_counter() - started))
    return times


def run_rank(rank: int, world_size: int, settings: BenchSettings, rounds: int) -> dict:
    import zerokit

    model = make_model(settings)
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_bytes": settings.bucket_bytes},
              "bf16": {"enabled": settings.dtype == "bf16"}}
    engine = zerokit.initialize(model, make_optimizer(model, settings), config)
    shards = engine.stage.shards
    agreement = shards.agreement
    _steps(engine, settings, rank, 0, settings.warmup)
    timed: dict[str, list[float]] = {arm: [] for arm in ARMS}
    step = settings.warmup
    pending_at_boundaries = []
    tables: dict[str, float] = {}  # per step, the arm's last round (a first step after a switch follows no order)
    for round_ in range(rounds):
        for arm in (ARMS if round_ % 2 == 0 else ARMS[::-1]):  # no arm always runs first
            pending_at_boundaries.append(len(agreement.pending))
            _settle(agreement)  # a row issued for a prefetch is waited on before the agreement is switched
            shards.agreement = None if arm == "unchecked" else agreement
            agreement.follow_orders = arm == "checked"
            issued = agreement.rounds
            timed[arm] += _steps(engine, settings, rank, step, settings.steps)
            tables[arm] = (agreement.rounds - issued) / settings.steps
            step += settings.steps
    _settle(agreement)
    shards.agreement, agreement.follow_orders = agreement, True
    return {"pending_at_boundaries": pending_at_boundaries, "steps": timed, "tables": tables,
            "fingerprint": _fingerprint_seconds(engine, settings, rounds), "units": len(engine.stage.units),
            "unit_params": shards.unit_numel[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each of the three arms")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--n-embd", type=int, default=BenchSettings.n_embd, help="width (heads of 64)")
    parser.add_argument("--n-layer", type=int, default=BenchSettings.n_layer)
    parser.add_argument("--out", default="bench_results/bench_reliability.json")
    args = parser.parse_args()
    settings = BenchSettings(world_size=args.world_size, steps=args.steps, warmup=2, dtype=args.dtype,
                             n_embd=args.n_embd, n_head=args.n_embd // 64, n_layer=args.n_layer)
    result = spawn(run_rank, args.world_size, settings, args.rounds)[0]
    checked, unchecked, rows = (statistics.median(result["steps"][arm]) for arm in ARMS)
    spread = statistics.pstdev(result["steps"]["unchecked"])
    fingerprint = statistics.median(result["fingerprint"])
    print(f"stage 3, {args.world_size} gloo ranks, {result['units']} units of {result['unit_params']:,} "
          f"parameters (the blocks), {args.dtype}, "
          f"{len(result['steps']['checked'])} steps each way")
    print(f"step with unit checks {checked:.4f} s, without {unchecked:.4f} s: ratio {checked / unchecked:.3f} "
          f"(step-to-step spread without: {spread:.4f} s)")
    print(f"step with a row beside every unit gather (a phase that follows no order) {rows:.4f} s: ratio "
          f"{rows / unchecked:.3f}")
    print(f"agreement tables per step (last round): {result['tables']}; pending between steps: "
          f"{result['pending_at_boundaries']}")
    print(f"start-up fingerprint (once, at initialize): {fingerprint * 1e3:.1f} ms, "
          f"{fingerprint / unchecked * 100:.1f}% of one step")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), **result}, indent=1))


if __name__ == "__main__":
    main()
