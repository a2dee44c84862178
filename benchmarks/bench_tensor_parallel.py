"""Tensor parallelism inside a node, data parallelism across: zerokit (AutoTP's split + ZeRO-2 over the replicas)
beside DeepSpeed 0.19.8's AutoTP + ZeRO-2 and torch's tensor parallelism + FSDP2 (torchtitan's composition), on the
same Hugging Face Llama, the same layout (2 tensor x 2 data ranks by default), the same batches and the same
optimizer (torch AdamW, no clipping), fp32.

    python benchmarks/bench_tensor_parallel.py --out benchmarks/results/tensor_parallel.json
    python benchmarks/bench_tensor_parallel.py --only zerokit,torch-tp-fsdp2 --steps 6

Each contender runs under torchrun in processes of its own (DeepSpeed patches torch). Measured: the step time (each
step after a barrier, the slowest rank's; the median over the timed steps), the step's CPU time, the growth of each
rank's resident high-water mark over its size before the model is built (the largest rank's), and the losses,
which must agree across contenders (rtol 1e-4: the three split the same sums at the same points).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONTENDERS = ("zerokit", "deepspeed-autotp", "torch-tp-fsdp2")
REPO = Path(__file__).resolve().parents[1]


def model_and_batches(args: argparse.Namespace):
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def batch(args: argparse.Namespace, step: int, replica: int):
    import torch
    generator = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=generator)


def loss_of(model, tokens):
    return model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss


def start(name: str, args: argparse.Namespace, model):
    """The contender's engine (or the parallelized module and its optimizer) over `model`."""
    import torch
    import torch.distributed as dist
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
              "tensor_parallel": {"autotp_size": args.tensor}, "zero_allow_untested_optimizer": True}
    if name == "zerokit":
        import zerokit
        engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
        return engine, engine.backward, engine.step
    if name == "deepspeed-autotp":
        import deepspeed
        deepspeed.init_distributed()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=config)
        return engine, engine.backward, engine.step
    from torch.distributed.fsdp import fully_shard
    from zerokit.parallel.mesh import Layout
    from zerokit.testing.tensor_parity import parallelize_llama
    mesh = Layout.resolve(dist.get_world_size(), tensor=args.tensor).device_mesh("cpu")
    parallelize_llama(model, mesh["tensor"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["data"])
    fully_shard(model, mesh=mesh["data"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, lambda loss: loss.backward(), step


def worker(name: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    replica = rank // args.tensor  # tensor groups are consecutive ranks
    Path("/proc/self/clear_refs").write_text("5")  # reset the resident high-water mark
    base = resident_peak()
    engine, backward, step = start(name, args, model_and_batches(args))
    losses, walls, cpus = [], [], []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        loss = loss_of(engine, batch(args, index, replica))
        backward(loss)
        step()
        elapsed = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        losses.append(loss.item())
        if index >= args.warmup:
            walls.append(elapsed[0].item())
            cpus.append(elapsed[1].item())
    peak = torch.tensor([resident_peak() - base], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(args.result).write_text(json.dumps({
            "step_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "peak_rss_mib": peak.item() / 2**20, "losses": losses}))


def resident_peak() -> int:
    """This process's resident high-water mark in bytes (VmHWM, which clear_refs resets)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def launch(name: str, args: argparse.Namespace, raw: list[str], result: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO),
                                                                                  os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.world_size), __file__, "--worker", name, "--result", str(result), *raw]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"failed": (done.stdout[-2000:] + done.stderr[-4000:])}
    return json.loads(result.read_text())


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(CONTENDERS))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    raw = [a for a in (argv if argv is not None else sys.argv[1:])]
    for flag in ("--only", "--out"):  # the workers' command lines carry the model and the steps only
        if flag in raw:
            at = raw.index(flag)
            del raw[at:at + 2]
    return args, raw


def main(argv: list[str] | None = None) -> int:
    args, raw = parse(argv)
    if args.worker:
        worker(args.worker, args)
        return 0
    import tempfile
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.only.split(","):
            results[name] = launch(name, args, raw, Path(scratch) / f"{name}.json")
            row = results[name]
            print(name, "failed:\n" + row["failed"] if "failed" in row else
                  f"step {row['step_s']:.3f} s, CPU {row['cpu_s']:.3f} s, peak RSS +{row['peak_rss_mib']:.0f} MiB, "
                  f"losses {[round(x, 5) for x in row['losses']]}", flush=True)
    trained = {name: row["losses"] for name, row in results.items() if "losses" in row}
    first = next(iter(trained.values()), [])
    agree = all(max(abs(a - b) / abs(b) for a, b in zip(losses, first)) < 1e-4 for losses in trained.values())
    print("losses agree across contenders (rtol 1e-4):", agree)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "losses_agree": agree},
                                             indent=1))
    return 0 if agree and all("losses" in row for row in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
