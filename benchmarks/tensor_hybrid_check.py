"""Tensor parallelism with hybrid sharding inside the data group, on 8 CPU ranks: a Llama split over tensor groups
of 2 (the config's tensor_parallel.autotp_size), ZeRO-3 over the 4 data replicas as MiCS (shard groups of 2,
2 replicas), against one process on the union of the replicas' batches. Too many ranks for the suite on 2 cores
(about a minute), so a check to run by hand; prints the worst loss difference (relative) and the largest
parameter difference.

    python benchmarks/tensor_hybrid_check.py
"""

from __future__ import annotations

from zerokit.testing.parity import Case, run_reference
from zerokit.testing.spawn import spawn
from zerokit.testing.tensor_parity import run_tensor_engine, tensor_config

CASE = Case("tensor-mics", 3, model="hf-llama-untied", steps=3, clip=0.05)
TENSOR, WORLD, SHARD = 2, 8, 2


def run(rank: int, world_size: int) -> dict:
    config = {**tensor_config(CASE, TENSOR), "ranks_per_node": 4}
    config["zero_optimization"] = {**config["zero_optimization"], "mics_shard_size": SHARD}
    return run_tensor_engine(rank, world_size, CASE, TENSOR, "zerokit", config)


def main() -> None:
    ranks = spawn(run, WORLD, timeout=900)
    reference = run_reference(CASE, WORLD // TENSOR)
    worst = max(abs(mine - theirs) / abs(theirs) for out in ranks
                for (_, _, mine), theirs in zip(out["losses"], [loss for _, replica, loss in reference["losses"]
                                                                if replica == out["replica"]]))
    largest = max((ranks[0]["params"][name] - value).abs().max().item() for name, value in reference["params"].items())
    print(f"tensor {TENSOR} x data {ranks[0]['data_ranks']} (MiCS shard groups of {SHARD}), ZeRO-3, "
          f"{CASE.steps} steps: losses within {worst:.1e} relative of one process, parameters within {largest:.1e}")


if __name__ == "__main__":
    main()
