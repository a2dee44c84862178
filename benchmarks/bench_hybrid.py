"""Hybrid sharding (issue 26) on 2 simulated nodes x 2 gloo ranks: the bytes each rank sends across nodes per
optimizer step, and the step time, for flat ZeRO-3 (one group over all 4 ranks), MiCS ZeRO-3 (`mics_shard_size: 2`,
shard groups inside each node, gradients averaged across the nodes once per step) and hpZ ZeRO-3
(`zero_hpz_partition_size: 2`, a secondary copy inside each node that every gather after a step's first reads), and
DeepSpeed 0.19.8's ZeRO-3 flat and with its own hpZ beside them (client torch AdamW, gloo).

    python benchmarks/bench_hybrid.py                      # benchmarks/workload.py's GPT, 2 micro-steps per step
    python benchmarks/bench_hybrid.py --n-layer 4 --n-embd 256 --accumulation 4 --steps 4

The nodes are simulated (`ranks_per_node: 2` in the config; every rank is on this machine): the bytes are what
zerokit counts (comm_stats()["cross_node"], See [Note: bytes that cross nodes] in zerokit/comm/collectives.py),
summed over the 4 ranks and per rank at most, and, for every row, DeepSpeed's too, the same bytes counted at torch's
c10d operators over one more, untimed step (a TorchDispatchMode that finds each collective's process group: the
same ring convention, applied to the calls whoever makes them; on the CPU DeepSpeed's small all-reduces may go
through its shared-memory op instead and are then not seen);
the step time is the median over --steps timed steps (after one
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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from benchmarks.commcount import COLLECTIVES, RING_FACTOR  # noqa: E402
from zerokit.testing.models import lm_loss  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

WORLD, PER_NODE = 4, 2
MODES = {"flat stage 3": {}, "MiCS stage 3 (s=2)": {"mics_shard_size": PER_NODE},
         "hpZ stage 3 (k=2)": {"zero_hpz_partition_size": PER_NODE},
         "DeepSpeed stage 3": {"deepspeed": True}, "DeepSpeed hpZ (k=2)": {"deepspeed": True,
                                                                        "zero_hpz_partition_size": PER_NODE}}
PROCESS_GROUP = torch._C._distributed_c10d.ProcessGroup


class CrossNodeCounter(TorchDispatchMode):
    """Bytes this rank sends to the other node, from the c10d operators: each collective's ring (its group's ranks
    in ascending order) crosses when this rank's successor is on the other node (See [Note: bytes that cross nodes]
    in zerokit/comm/collectives.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0.0
        self.rings: dict[int, tuple[bool, int]] = {}  # id(group) -> (crosses, ranks)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in COLLECTIVES:
            kind, position = COLLECTIVES[func]
            crosses, size = self._ring(args)
            if crosses:
                tensors = [t for t in tree_leaves(args[position]) if isinstance(t, torch.Tensor)]
                self.bytes += RING_FACTOR[kind](size) * sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))

    def _ring(self, args: tuple) -> tuple[bool, int]:
        boxed = next(a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
        group = PROCESS_GROUP.unbox(boxed)
        if id(group) not in self.rings:
            ranks = sorted(dist.get_process_group_ranks(group))
            me = dist.get_rank()
            following = ranks[(ranks.index(me) + 1) % len(ranks)]
            self.rings[id(group)] = (me // PER_NODE != following // PER_NODE, len(ranks))
        return self.rings[id(group)]


def config(settings: BenchSettings, hybrid: dict, accumulation: int) -> dict:
    return {"zero_optimization": {"stage": 3, "reduce_bucket_bytes": settings.bucket_bytes, **hybrid},
            "ranks_per_node": PER_NODE, "gradient_accumulation_steps": accumulation,
            "train_micro_batch_size_per_gpu": settings.batch_size}


def deepspeed_engine(settings: BenchSettings, hybrid: dict, accumulation: int):
    import deepspeed

    from benchmarks.contenders import _deepspeed_comm

    _deepspeed_comm()
    model = make_model(settings)
    zero = {"stage": 3, "reduce_bucket_size": settings.bucket_bytes // 4, "allgather_bucket_size":
            settings.bucket_bytes // 4, "overlap_comm": True,
            "zero_hpz_partition_size": hybrid.get("zero_hpz_partition_size", 1)}
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, settings), config={
        "train_micro_batch_size_per_gpu": settings.batch_size, "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**30})
    return engine


def run_rank(rank: int, world_size: int, settings: BenchSettings, hybrid: dict, accumulation: int) -> dict:
    import zerokit

    if hybrid.get("deepspeed"):
        engine = deepspeed_engine(settings, hybrid, accumulation)
    else:
        model = make_model(settings)
        engine = zerokit.initialize(model, make_optimizer(model, settings), config(settings, hybrid, accumulation))

    def one_step(step: int) -> None:
        for micro in range(accumulation):
            tokens = make_batch(settings, rank, step * accumulation + micro)
            engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
            engine.step()

    times, crossed = [], None
    for step in range(settings.warmup + settings.steps):
        dist.barrier()
        before, start = _crossed(engine), time.perf_counter()
        one_step(step)
        if step >= settings.warmup:
            times.append(time.perf_counter() - start)
            crossed = _crossed(engine) - before if before is not None else None
    counter = CrossNodeCounter()
    with counter:
        one_step(settings.warmup + settings.steps)
    if hasattr(engine, "close"):
        engine.close()
    return {"times": times, "cross_node": crossed, "c10d_cross_node": round(counter.bytes)}


def _crossed(engine) -> int | None:
    """zerokit's own count of the bytes sent across nodes so far (None for DeepSpeed, which keeps none)."""
    return engine.comm_stats()["cross_node"]["bytes"] if hasattr(engine, "comm_stats") else None


def measure(settings: BenchSettings, accumulation: int, rounds: int) -> dict[str, dict]:
    results: dict[str, dict] = {name: {"step_s": []} for name in MODES}
    for _ in range(rounds):
        for name, hybrid in MODES.items():
            ranks = spawn(run_rank, WORLD, settings, hybrid, accumulation, timeout=1200)
            slowest = [max(step) for step in zip(*(r["times"] for r in ranks))]
            results[name]["step_s"] += slowest
            results[name]["cross"] = [r["cross_node"] for r in ranks]  # the last timed step's (every step's alike)
            results[name]["c10d_cross"] = [r["c10d_cross_node"] for r in ranks]
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
    print(f"{'mode':<22} {'cross-node MB/step, sum of ranks':>33} {'max per rank':>13} {'at c10d: sum':>13} "
          f"{'step s (median)':>16}")
    for name, result in results.items():
        cross, c10d = result["cross"], result["c10d_cross"]
        own = (f"{sum(cross) / 1e6:>33.2f} {max(cross) / 1e6:>13.2f}" if cross[0] is not None
               else f"{'(counts none)':>33} {max(c10d) / 1e6:>13.2f}")
        print(f"{name:<22} {own} {sum(c10d) / 1e6:>13.2f} {statistics.median(result['step_s']):>16.3f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": settings.as_dict(), "accumulation": args.accumulation,
                                         "parameters": numel, "results": results}, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
