"""Hybrid sharding (issue 26) on 2 simulated nodes x 2 gloo ranks: the bytes each rank sends across nodes per
optimizer step, and the step time, for flat ZeRO-3 (one group over all 4 ranks), MiCS ZeRO-3 (`mics_shard_size: 2`,
shard groups inside each node, gradients averaged across the nodes once per step) and hpZ ZeRO-3
(`zero_hpz_partition_size: 2`, a secondary copy inside each node that every gather after a step's first reads).

    python benchmarks/bench_hybrid.py                      # benchmarks/workload.py's GPT, 2 micro-steps per step
    python benchmarks/bench_hybrid.py --n-layer 4 --n-embd 256 --accumulation 4 --steps 4

The nodes are simulated (`ranks_per_node: 2` in the config; every rank is on this machine): the bytes are what
zerokit counts (comm_stats()["cross_node"], See [Note: bytes that cross nodes] in zerokit/comm/collectives.py),
summed over the 4 ranks and per rank at most; the step time is the median over --steps timed steps (after one
warm-up step) of the slowest rank, with no slow link between the "nodes", so it shows what MiCS costs on one host
(the replica all-reduce at the boundary), not what it saves on a real network. The modes take turns for
--rounds rounds (a shared 2-core machine: the load average is printed beside the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.workload import BenchSettings, make_batch, make_model, make_optimizer  # noqa: E402
from zerokit.testing.models import lm_loss  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

WORLD, PER_NODE = 4, 2
MODES = {"flat stage 3": {}, "MiCS stage 3 (s=2)": {"mics_shard_size": PER_NODE},
         "hpZ stage 3 (k=2)": {"zero_hpz_partition_size": PER_NODE}}


def config(settings: BenchSettings, hybrid: dict, accumulation: int) -> dict:
    return {"zero_optimization": {"stage": 3, "reduce_bucket_bytes": settings.bucket_bytes, **hybrid},
            "ranks_per_node": PER_NODE, "gradient_accumulation_steps": accumulation,
            "train_micro_batch_size_per_gpu": settings.batch_size}


def run_rank(rank: int, world_size: int, settings: BenchSettings, hybrid: dict, accumulation: int) -> dict:
    import zerokit

    model = make_model(settings)
    engine = zerokit.initialize(model, make_optimizer(model, settings), config(settings, hybrid, accumulation))
    times, crossed, sent = [], [], []
    for step in range(settings.warmup + settings.steps):
        dist.barrier()
        before, start = engine.comm_stats(), time.perf_counter()
        for micro in range(accumulation):
            tokens = make_batch(settings, rank, step * accumulation + micro)
            engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
            engine.step()
        elapsed, after = time.perf_counter() - start, engine.comm_stats()
        if step >= settings.warmup:
            times.append(elapsed)
            crossed.append(after["cross_node"]["bytes"] - before["cross_node"]["bytes"])
            sent.append(sum(after[k]["bytes"] - before[k]["bytes"] for k in after if "." in k))
    engine.close()
    return {"times": times, "cross_node": crossed, "logical": sent}


def measure(settings: BenchSettings, accumulation: int, rounds: int) -> dict[str, dict]:
    results: dict[str, dict] = {name: {"step_s": [], "cross": None} for name in MODES}
    for _ in range(rounds):
        for name, hybrid in MODES.items():
            ranks = spawn(run_rank, WORLD, settings, hybrid, accumulation, timeout=1200)
            slowest = [max(step) for step in zip(*(r["times"] for r in ranks))]
            results[name]["step_s"] += slowest
            results[name]["cross"] = [r["cross_node"][-1] for r in ranks]  # equal every step
            results[name]["logical"] = [r["logical"][-1] for r in ranks]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    settings = replace(BenchSettings(world_size=WORLD, steps=args.steps, warmup=1), n_layer=args.n_layer,
                       n_embd=args.n_embd, n_head=max(1, args.n_embd // 64))
    numel = sum(p.numel() for p in make_model(settings).parameters())
    results = measure(settings, args.accumulation, args.rounds)
    print(f"2 simulated nodes x 2 gloo ranks, TinyGPT {args.n_layer}x{args.n_embd} ({numel:,} parameters, fp32), "
          f"{args.accumulation} micro-steps of {settings.batch_size}x{settings.block_size} tokens per rank per step; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'mode':<22} {'cross-node MB/step (sum of ranks)':>34} {'max per rank':>13} {'step s (median)':>16}")
    for name, result in results.items():
        cross = result["cross"]
        print(f"{name:<22} {sum(cross) / 1e6:>34.2f} {max(cross) / 1e6:>13.2f} "
              f"{statistics.median(result['step_s']):>16.3f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": settings.as_dict(), "accumulation": args.accumulation,
                                         "parameters": numel, "results": results}, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
