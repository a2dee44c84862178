"""Offload tiers (issue 10): the CPU optimizer step, NVMe throughput, and one training step in each offload mode,
zerokit beside DeepSpeed in the same mode, on the same model, data and ranks.

    python benchmarks/bench_offload.py                       # all three parts
    python benchmarks/bench_offload.py --part adam --sizes 10e6,100e6,1e9
    python benchmarks/bench_offload.py --part nvme --nvme-path /tmp --nvme-mib 1024
    python benchmarks/bench_offload.py --part modes

- adam: one AdamW step over an fp32 shard of N elements in a fresh process per (implementation, size):
  torch foreach, torch fused, DeepSpeedCPUAdam (its op is built on first use, outside the timing); the
  median of --repeats steps after one warm-up step.
- nvme: zerokit's swap files (aligned buffers, O_DIRECT, 4 I/O threads, 16 MiB records, as the NVMe tiers
  use them) writing then reading --nvme-mib, beside `dd` with oflag/iflag=direct and the same record size on
  the same file system: the raw bandwidth.
- modes: 2 gloo ranks train benchmarks/workload.py's GPT (--n-layer, --n-embd: a larger one) under each offload
  mode, zerokit (torch AdamW) and DeepSpeed (its DeepSpeedCPUAdam, as its offload runs it); median step time of
  the slowest rank, peak RSS growth of rank 0 (from before the model is built) beside the same family's run
  without offload at the same stage, zerokit's memory_by_tier() host and NVMe bytes, and the eval loss. A
  DeepSpeed mode that cannot run here says why (its NVMe needs libaio): the table then sets its CPU offload
  beside zerokit's NVMe, marked so; its stages 1-2 run offload_optimizer.device=nvme as CPU offload
  (stage_1_and_2.py offloads to the CPU for any device but none), which the table says too. Parameters on NVMe are measured with max_in_cpu 0 and with DeepSpeed's
  default 1e9, which keeps every shard of a model this size in host memory (a cache, in both).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

class Mode(NamedTuple):
    stage: int
    optimizer: str  # offload_optimizer.device
    params: str = "none"  # offload_param.device
    max_in_cpu: int | None = None  # offload_param.max_in_cpu with nvme (None: the default, DeepSpeed's 1e9)

    @property
    def baseline(self) -> str:
        """The mode without offload it is measured against."""
        return f"none-stage{self.stage}"

    @property
    def cpu_twin(self) -> str | None:
        """The CPU-offload mode set beside an NVMe one where a peer's NVMe cannot run."""
        if self.optimizer != "nvme":
            return None
        return "optimizer+params-cpu" if self.params != "none" else f"optimizer-cpu-stage{self.stage}"


MODES = {  # what each offload mode costs is read against the run without offload at its stage
    "none-stage2": Mode(2, "none"),
    "optimizer-cpu-stage2": Mode(2, "cpu"),
    "optimizer-nvme-stage2": Mode(2, "nvme"),
    "none-stage3": Mode(3, "none"),
    "optimizer-cpu-stage3": Mode(3, "cpu"),
    "optimizer+params-cpu": Mode(3, "cpu", "cpu"),
    "optimizer-nvme-stage3": Mode(3, "nvme"),
    "optimizer+params-nvme": Mode(3, "nvme", "nvme", max_in_cpu=0),
    "optimizer+params-nvme-cached": Mode(3, "nvme", "nvme"),
}
ADAM_IMPLEMENTATIONS = ("torch-foreach", "torch-fused", "deepspeed-cpu-adam")
RECORD_BYTES = 16 * 2**20


# --- adam -----------------------------------------------------------------------------------------------------

ADAM_CHILD = """
import json, statistics, sys, time, torch
impl, numel, repeats = sys.argv[1], int(float(sys.argv[2])), int(sys.argv[3])
param = torch.nn.Parameter(torch.randn(numel))
param.grad = torch.randn(numel)
if impl == "deepspeed-cpu-adam":
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    optimizer = DeepSpeedCPUAdam([param], lr=1e-3, adamw_mode=True)
else:
    optimizer = torch.optim.AdamW([param], lr=1e-3, foreach=impl == "torch-foreach", fused=impl == "torch-fused")
optimizer.step()  # state allocated, op loaded
times = []
for _ in range(repeats):
    started = time.perf_counter()
    optimizer.step()
    times.append(time.perf_counter() - started)
print(json.dumps({"seconds": statistics.median(times), "threads": torch.get_num_threads()}))
"""


def bench_adam(sizes: list[float], repeats: int) -> list[dict]:
    rows = []
    for numel in sizes:
        for impl in ADAM_IMPLEMENTATIONS:
            run = subprocess.run([sys.executable, "-c", ADAM_CHILD, impl, str(numel), str(repeats)],
                                 capture_output=True, text=True)
            row = {"numel": int(numel), "implementation": impl}
            if run.returncode == 0:
                row.update(json.loads(run.stdout.strip().splitlines()[-1]))
            else:
                row["error"] = (run.stderr.strip().splitlines() or ["failed"])[-1][:160]
            rows.append(row)
            print(_adam_line(row), flush=True)
    return rows


def _adam_line(row: dict) -> str:
    what = f"{row['seconds']:.4f} s" if "seconds" in row else f"failed: {row['error']}"
    return f"adam {row['numel']:>13,} elements  {row['implementation']:<20} {what}"


# --- nvme -----------------------------------------------------------------------------------------------------

def bench_nvme(nvme_path: str, mib: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from zerokit.tiers.swap import SwapFile, aligned_bytes

    records = max(1, mib * 2**20 // RECORD_BYTES)
    with tempfile.TemporaryDirectory(dir=nvme_path) as folder:
        swap = SwapFile(Path(folder) / "zerokit.swap")
        buffers = [aligned_bytes(RECORD_BYTES) for _ in range(4)]
        for buffer in buffers:
            buffer.random_(0, 255)
        with ThreadPoolExecutor(max_workers=4) as pool:
            write = _timed(lambda: list(pool.map(lambda i: swap.write(i * RECORD_BYTES, buffers[i % 4]), range(records))))
            read = _timed(lambda: list(pool.map(lambda i: swap.read(i * RECORD_BYTES, buffers[i % 4]), range(records))))
        swap.close()
        raw_write = _dd(["if=/dev/zero", f"of={folder}/dd.swap", "oflag=direct", f"count={records}"])
        raw_read = _dd([f"if={folder}/dd.swap", "of=/dev/null", "iflag=direct", f"count={records}"])
    total = records * RECORD_BYTES
    result = {"bytes": total, "direct_io": swap.direct, "zerokit_write_gbs": total / write / 1e9,
              "zerokit_read_gbs": total / read / 1e9, "dd_write_gbs": raw_write, "dd_read_gbs": raw_read}
    print(f"nvme {total / 2**20:.0f} MiB under {nvme_path} (direct I/O: {swap.direct}): zerokit write "
          f"{result['zerokit_write_gbs']:.2f} GB/s, read {result['zerokit_read_gbs']:.2f} GB/s; dd write "
          f"{raw_write:.2f} GB/s, read {raw_read:.2f} GB/s; zerokit/dd write {result['zerokit_write_gbs'] / raw_write:.2f}, "
          f"read {result['zerokit_read_gbs'] / raw_read:.2f}", flush=True)
    return result


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _dd(operands: list[str]) -> float:
    """GB/s as dd reports it (its last line: '... copied, 1.2 s, 1.7 GB/s')."""
    run = subprocess.run(["dd", f"bs={RECORD_BYTES}", *operands], capture_output=True, text=True, check=True)
    seconds = float(re.search(r"copied, ([0-9.]+) s", run.stderr).group(1))
    copied = int(re.search(r"^(\d+) bytes", run.stderr.strip().splitlines()[-1]).group(1))
    return copied / seconds / 1e9


# --- modes ----------------------------------------------------------------------------------------------------

def _offload_blocks(mode: Mode, nvme_path: str) -> dict:
    blocks = {}
    if mode.optimizer != "none":
        blocks["offload_optimizer"] = {"device": mode.optimizer,
                                       **({"nvme_path": nvme_path} if mode.optimizer == "nvme" else {})}
    if mode.params != "none":
        blocks["offload_param"] = {"device": mode.params, **({"nvme_path": nvme_path} if mode.params == "nvme" else {}),
                                   **({"max_in_cpu": mode.max_in_cpu} if mode.max_in_cpu is not None else {})}
    return blocks


def _engine(family: str, mode: Mode, settings, nvme_path: str):
    import torch

    from benchmarks.workload import adamw_hyperparameters, make_model, make_optimizer, optimizer_groups

    model = make_model(settings)
    zero = {"stage": mode.stage, **_offload_blocks(mode, nvme_path)}
    if family == "zerokit":
        import zerokit

        zero["reduce_bucket_bytes"] = settings.bucket_bytes
        return zerokit.initialize(model, make_optimizer(model, settings), {"zero_optimization": zero})
    import deepspeed

    from benchmarks.contenders import _deepspeed_comm

    _deepspeed_comm()
    zero.update(reduce_bucket_size=settings.bucket_bytes // 4, overlap_comm=True)
    hyper = adamw_hyperparameters(settings)  # the same AdamW as zerokit's (torch's eps and the groups' decay)
    config = {"train_micro_batch_size_per_gpu": settings.batch_size, "zero_optimization": zero,
              "gradient_clipping": 0.0, "steps_per_print": 2**30,
              "optimizer": {"type": "AdamW", "params": {"lr": hyper["lr"], "betas": list(hyper["betas"]), "eps": 1e-8}}}
    torch.manual_seed(settings.seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=optimizer_groups(model), config=config)
    return engine


def _mode_rank(rank: int, world_size: int, family: str, mode: Mode, settings, nvme_path: str) -> dict:
    import torch.distributed as dist

    from benchmarks.accounting import peak_growth, start_peak_memory
    from benchmarks.harness import warm_up_libraries
    from benchmarks.workload import EVAL_RANK, make_batch
    from zerokit.testing.models import lm_loss

    warm_up_libraries()
    memory = start_peak_memory()
    engine = _engine(family, mode, settings, nvme_path)
    times = []
    for step in range(settings.warmup + settings.steps):
        tokens = make_batch(settings, rank, step)
        dist.barrier()
        started = time.perf_counter()
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()
        if step >= settings.warmup:
            times.append(time.perf_counter() - started)
    import torch

    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        tokens = make_batch(settings, EVAL_RANK, 0)
        loss = lm_loss(engine(tokens[:, :-1]), tokens).item()
    row = {"step_seconds": statistics.median(slowest.tolist()), "peak_rss_growth": peak_growth(memory),
           "eval_loss": loss}
    if family == "zerokit":  # what it says it holds in host memory and in swap files
        tiers = engine.memory_by_tier()
        row.update(host_bytes=sum(tiers["host"].values()), nvme_bytes=sum(tiers["nvme"].values()))
    return row


def bench_modes(nvme_path: str, steps: int, n_layer: int | None, n_embd: int | None) -> list[dict]:
    from benchmarks.workload import BenchSettings
    from zerokit.testing.spawn import spawn

    size = {name: value for name, value in (("n_layer", n_layer), ("n_embd", n_embd)) if value is not None}
    settings = BenchSettings(world_size=2, steps=steps, warmup=2, **size)
    rows = []
    for name, mode in MODES.items():
        for family in ("zerokit", "deepspeed"):
            row = {"mode": name, "family": family}
            try:
                row.update(spawn(_mode_rank, 2, family, mode, settings, nvme_path, timeout=1800)[0])
            except Exception as error:  # a peer mode that cannot run here (DeepSpeed's NVMe needs libaio)
                row["error"] = _last_error_line(str(error))
            rows.append(row)
            print(_mode_line(row), flush=True)
    print(mode_table(rows), flush=True)
    return rows


def _last_error_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "failed")[:200]


def _mode_line(row: dict) -> str:
    if "error" in row:
        return f"{row['mode']:<28} {row['family']:<9} failed: {row['error']}"
    tiers = (f"  host {row['host_bytes'] / 2**20:6.1f} MiB, NVMe {row['nvme_bytes'] / 2**20:6.1f} MiB"
             if "host_bytes" in row else "")
    return (f"{row['mode']:<28} {row['family']:<9} step {row['step_seconds']:.3f} s  peak RSS growth "
            f"{row['peak_rss_growth'] / 2**20:7.1f} MiB{tiers}  eval loss {row['eval_loss']:.6f}")


def mode_table(rows: list[dict]) -> str:
    """Markdown: per mode, each family's step time and peak RSS growth, and that growth against the same
    family's run without offload at the mode's stage. Where DeepSpeed could not run a mode, its CPU offload
    twin's numbers stand beside it, marked."""
    found = {(row["mode"], row["family"]): row for row in rows}
    lines = ["| mode | zerokit step s | zerokit peak RSS MiB | vs no offload | zerokit host / NVMe MiB "
             "| DeepSpeed step s | DeepSpeed peak RSS MiB | vs no offload |", "|---|---|---|---|---|---|---|---|"]
    for name, mode in MODES.items():
        ours = found.get((name, "zerokit"), {})
        theirs, note = found.get((name, "deepspeed"), {}), ""
        if mode.optimizer == "nvme" and mode.stage < 3 and "error" not in theirs:
            note = " (its stages 1-2 offload to the CPU for nvme too: no swap files)"
        if "error" in theirs and mode.cpu_twin is not None:
            theirs = found.get((mode.cpu_twin, "deepspeed"), {})
            note = f" (its CPU offload, {mode.cpu_twin}: its NVMe failed)"
        lines.append(f"| {name} | {_cells(ours, found.get((mode.baseline, 'zerokit'), {}))} "
                     f"| {_tiers(ours)} | {_cells(theirs, found.get((mode.baseline, 'deepspeed'), {}))}{note} |")
    return "\n".join(lines)


def _cells(row: dict, baseline: dict) -> str:
    """step s | peak MiB | difference from the baseline's peak, MiB."""
    if "peak_rss_growth" not in row:
        return f"failed: {row.get('error', 'not run')[:60]} | | "
    peak = row["peak_rss_growth"] / 2**20
    versus = f"{peak - baseline['peak_rss_growth'] / 2**20:+.1f}" if "peak_rss_growth" in baseline else ""
    return f"{row['step_seconds']:.3f} | {peak:.1f} | {versus}"


def _tiers(row: dict) -> str:
    return f"{row['host_bytes'] / 2**20:.1f} / {row['nvme_bytes'] / 2**20:.1f}" if "host_bytes" in row else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="all", choices=("all", "adam", "nvme", "modes"))
    parser.add_argument("--sizes", default="10e6,100e6,1e9", help="AdamW shard sizes (elements)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--nvme-mib", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    parser.add_argument("--n-layer", type=int, default=None, help="modes: the GPT's blocks (default: the workload's)")
    parser.add_argument("--n-embd", type=int, default=None, help="modes: the GPT's width (default: the workload's)")
    parser.add_argument("--out", default="bench_results/bench_offload.json")
    args = parser.parse_args()
    results = {}
    if args.part in ("all", "adam"):
        results["adam"] = bench_adam([float(s) for s in args.sizes.split(",")], args.repeats)
    if args.part in ("all", "nvme"):
        results["nvme"] = bench_nvme(args.nvme_path, args.nvme_mib)
    if args.part in ("all", "modes"):
        results["modes"] = bench_modes(args.nvme_path, args.steps, args.n_layer, args.n_embd)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), **results}, indent=1))


if __name__ == "__main__":
    main()
