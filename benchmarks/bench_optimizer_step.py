"""Time one optimizer step of an `optimizer` block as zerokit builds it (torch's fused kernel) against the same
block with `"fused": false` (torch's default implementation), over fp32 masters cut into the engine's CPU
pieces (See [Note: optimizer pieces] in zerokit/masters/shards.py and [Note: fused optimizer kernels] in
zerokit/engine/schedules.py).

    python benchmarks/bench_optimizer_step.py                         # AdamW and SGD, 10.9M elements, 1 thread
    python benchmarks/bench_optimizer_step.py --elements 2000000 --threads 2 --types AdamW
    python benchmarks/bench_optimizer_step.py --elements 150000000 --threads 2 --types AdamW --norm

Each row: the median of --repeats timed steps after two warm-up steps (the first fills the optimizer state).
--norm adds the step's float64 sum of squares over as many gradient elements, in chunks of one 32K-element grain and
of one grain per thread (the engine's: See [Note: the float64 sum of squares in chunks] in zerokit/precision/arithmetic.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zerokit.config.defaults import CPU_OPTIMIZER_PIECE_NUMEL
from zerokit.precision import CPU_NORM_CHUNK_NUMEL_PER_THREAD, square_sum
from zerokit.config.dsconfig.blocks import OptimizerSpec
from zerokit.engine.schedules import build_optimizer

PARAMS = {"AdamW": {"lr": 1e-3, "weight_decay": 0.01}, "Adam": {"lr": 1e-3}, "SGD": {"lr": 0.1, "momentum": 0.9}}


def step_ms(type_name: str, params: dict, elements: int, piece: int, repeats: int) -> float:
    """Median milliseconds of one step over `elements` fp32 values in pieces of `piece`."""
    master = torch.randn(elements)
    pieces = [torch.nn.Parameter(master[begin:begin + piece]) for begin in range(0, elements, piece)]
    for part in pieces:
        part.grad = torch.randn_like(part)
    (optimizer,) = build_optimizer(OptimizerSpec(type=type_name, params=params), pieces)
    return median_ms(optimizer.step, repeats, warm_up=2)


def median_ms(run, repeats: int, warm_up: int) -> float:
    """Median milliseconds of `repeats` calls of `run` after `warm_up` untimed ones."""
    for _ in range(warm_up):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=10_900_000, help="fp32 elements stepped")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's test ranks use 1)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per row")
    parser.add_argument("--types", default="AdamW,SGD", help="optimizer block types, comma-separated")
    parser.add_argument("--norm", action="store_true", help="also time the float64 sum of squares by chunk size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.elements} fp32 elements, {args.threads} thread(s), median of {args.repeats} steps")
    print("| type | pieces of | default ms | fused ms | default / fused |")
    print("|---|---|---|---|---|")
    for type_name in args.types.split(","):
        for piece in (CPU_OPTIMIZER_PIECE_NUMEL, args.elements):
            default = step_ms(type_name, {**PARAMS[type_name], "fused": False}, args.elements, piece, args.repeats)
            fused = step_ms(type_name, PARAMS[type_name], args.elements, piece, args.repeats)
            print(f"| {type_name} | {piece} | {default:.1f} | {fused:.1f} | {default / fused:.1f} |")
    if args.norm:
        print_norm_times(args.elements, args.repeats)


def print_norm_times(elements: int, repeats: int) -> None:
    """Median milliseconds of the float64 sum of squares over `elements` fp32 values, by chunk size."""
    grads = [torch.randn(elements)]
    print("| sum of squares in chunks of | ms |")
    print("|---|---|")
    for chunk in sorted({CPU_NORM_CHUNK_NUMEL_PER_THREAD, CPU_NORM_CHUNK_NUMEL_PER_THREAD * torch.get_num_threads()}):
        print(f"| {chunk} | {median_ms(lambda: square_sum(grads, chunk), repeats, warm_up=1):.1f} |")


if __name__ == "__main__":
    main()
