"""Offload on one GPU (issue 34, item 3): what moving the optimizer to host memory costs as the batch grows, and the
largest model that trains with it, beside DeepSpeed's CPU offload on the same card.

    python benchmarks/bench_offload_gpu.py batch --accumulation 1,4,16
    python benchmarks/bench_offload_gpu.py largest --hidden 4096 --n-layer 24 --mlp-hidden 11008

batch: benchmarks/workload.py's GPT (gpu_check.py's shape, 336.9M parameters, bf16, micro-batches of 8 x 1024
tokens) at ZeRO-2 with the optimizer on the GPU and offloaded to pinned host memory (ZeRO-Offload's set-up), and
DeepSpeed's stage 2 with the same offload where it imports, each at every accumulation count: seconds per optimizer
step and tokens/s. ZeRO-Offload's paper reports near parity for large batches: the host's step is paid once per
optimizer step, the GPU's compute once per micro-batch.
largest: a Llama (benchmarks/llama.py) of the shape given, at stage 3 with the optimizer and the parameters in
pinned host memory, under zerokit and DeepSpeed, and zerokit without offload (which must not fit where the card
is smaller than the model states): whether two steps train (finite losses), the GPU's peak, the process's peak RSS
(VmHWM), seconds per step.
DeepSpeed's offload wants its own CPU Adam, a C++ extension it builds at first use (4.7 minutes on this 2-core
machine, the CUDA toolkit on a GPU image); by default DeepSpeed runs torch's AdamW on the host instead
(`zero_force_ds_cpu_optimizer: false`), as zerokit does, so that the two differ in how they offload, not in their
Adam; --deepspeed-adam deepspeed asks for its own. The row names which. --phases adds zerokit's own phase times
(wall_clock_breakdown: forward, backward, and the step's norm, optimizer and publishing), to see where a step goes. Every contender runs in a process of its own, so that its peak RSS and pinned memory are its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/bench_offload_gpu.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

ROOT = Path(__file__).resolve().parent.parent
MIB, GIB = 2 ** 20, 2 ** 30
BATCH_CONTENDERS = ("zerokit-2", "zerokit-2-offload", "deepspeed-2-offload")
LARGEST_CONTENDERS = ("zerokit-3", "zerokit-3-offload", "deepspeed-3-offload")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("batch", "largest", "child"))
    parser.add_argument("--accumulation", default="1,4,16", help="batch: accumulation counts, comma-separated")
    parser.add_argument("--only", default="", help="contenders, comma-separated (default: the part's all)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps after one untimed")
    parser.add_argument("--fused", action="store_true", help="torch's AdamW with fused=True (also on the host)")
    parser.add_argument("--phases", action="store_true",
                        help="zerokit's wall_clock_breakdown: each timed step's phases (forward, backward, the norm, "
                             "the optimizer, publishing), medians in the row (each reading synchronizes the device)")
    parser.add_argument("--deepspeed-adam", choices=("torch", "deepspeed"), default="torch",
                        help="DeepSpeed's host optimizer: torch's AdamW, or its own CPU Adam (built at first use: "
                             "minutes, and the CUDA toolkit on a GPU image)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--mlp-hidden", type=int, default=11008)
    parser.add_argument("--seq", type=int, default=2048, help="largest: tokens per sequence (one sequence a step)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one contender's process")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--contender", default="", help=argparse.SUPPRESS)  # child: which one
    parser.add_argument("--accumulate", type=int, default=1, help=argparse.SUPPRESS)  # child: its count
    parser.add_argument("--model", default="gpt", help=argparse.SUPPRESS)  # child: gpt | llama
    return parser.parse_args(argv)


# --- one contender, in a process of its own ---------------------------------------------------------------------

def child(args: argparse.Namespace) -> dict[str, Any]:
    from zerokit.comm.process import default_device, ensure_process_group
    ensure_process_group()
    device = default_device()
    torch.backends.cuda.matmul.allow_tf32 = True
    family, stage, offload = parse_contender(args.contender)
    model, micro_batch, seq, vocab = build_model(args, family, stage, offload)
    try:
        return train(model, args, family, stage, offload, micro_batch, seq, vocab, device)
    except torch.OutOfMemoryError as error:  # the answer for a model too large for the card, not a failure
        return {"trains": False, "error": f"OutOfMemoryError: {str(error)[:300]}", **memory(device)}


def train(model, args: argparse.Namespace, family: str, stage: int, offload: bool, micro_batch: int, seq: int,
          vocab: int, device: torch.device) -> dict[str, Any]:
    """One untimed optimizer step, then `args.steps` timed ones, each of `args.accumulate` micro-batches."""
    engine, which_adam = (deepspeed_engine if family == "deepspeed" else zerokit_engine)(
        model, args, stage, offload, micro_batch)
    generator = torch.Generator().manual_seed(0)
    seconds, losses, phases = [], [], []
    for step in range(1 + args.steps):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        started = time.perf_counter()
        for _ in range(args.accumulate):
            tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=generator).to(device)
            logits = engine(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        if step:
            seconds.append(time.perf_counter() - started)
            phases.append(getattr(getattr(engine, "monitor", None), "wall_clock_times", {}))
    step_s = sorted(seconds)[len(seconds) // 2]
    phase_ms = {phase: sorted(times[phase] for times in phases)[len(phases) // 2] for phase in phases[-1]}
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    return {"trains": all(math.isfinite(loss) for loss in losses), "adam": which_adam, "parameters": parameters,
            "step_s": step_s, "tokens_per_s": args.accumulate * micro_batch * seq / step_s,
            "losses": losses[-3:], **({"phase_ms": phase_ms} if phase_ms else {}), **memory(device)}


def parse_contender(name: str) -> tuple[str, int, bool]:
    family, stage, *rest = name.split("-")
    return family, int(stage), rest == ["offload"]


def build_model(args: argparse.Namespace, family: str, stage: int, offload: bool):
    """The model, and the micro-batch, sequence length and vocabulary its batches have. The Llama is built on the
    meta device for zerokit's stage 3 (materialised unit by unit where its shards live) and inside DeepSpeed's
    zero.Init (partitioned as it is built), so that neither needs the whole fp32 model in host memory first."""
    torch.manual_seed(0)  # every contender starts from the same weights (where it builds them alike)
    if args.model == "gpt":
        from benchmarks.gpu_check import parse_args as check_args, settings_of
        from benchmarks.workload import make_model
        settings = settings_of(check_args([]))
        return make_model(settings), settings.batch_size, settings.block_size, settings.vocab_size
    from benchmarks.llama import Llama, LlamaConfig
    config = LlamaConfig(hidden=args.hidden, n_layer=args.n_layer, n_head=args.hidden // 128,
                         n_kv_head=max(1, args.hidden // 512), mlp_hidden=args.mlp_hidden)
    if family == "deepspeed":
        _deepspeed_comm()
        import deepspeed
        with deepspeed.zero.Init(remote_device="cpu" if offload else None, pin_memory=offload,
                                 config_dict_or_path=deepspeed_config(args, stage, offload, 1)):
            return Llama(config), 1, args.seq, config.vocab_size
    if stage == 3:
        with torch.device("meta"):
            return Llama(config), 1, args.seq, config.vocab_size
    return Llama(config), 1, args.seq, config.vocab_size


def _normal_init(module: torch.nn.Module) -> None:
    """The Llama's own initialisation, for one module materialised by zerokit's stage 3."""
    for param in module.parameters(recurse=False):
        torch.nn.init.normal_(param, std=0.02) if param.dim() == 2 else torch.nn.init.ones_(param)


def adamw(params, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=fused or None)


def zerokit_engine(model, args: argparse.Namespace, stage: int, offload: bool, micro_batch: int):
    import zerokit
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"zero_optimization": zero, "bf16": {"enabled": True}, "gradient_accumulation_steps": args.accumulate,
              "train_micro_batch_size_per_gpu": micro_batch, "wall_clock_breakdown": args.phases}
    on_meta = next(model.parameters()).is_meta
    engine = zerokit.initialize(model, adamw(model.parameters(), args.fused), config,
                                param_init=_normal_init if on_meta else None)
    return engine, "torch AdamW" + (" (fused)" if args.fused else "")


def deepspeed_config(args: argparse.Namespace, stage: int, offload: bool, micro_batch: int) -> dict:
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": args.accumulate,
            "zero_optimization": zero, "bf16": {"enabled": True}, "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2 ** 30}


def deepspeed_engine(model, args: argparse.Namespace, stage: int, offload: bool, micro_batch: int):
    """DeepSpeed's engine, with its own CPU Adam where that builds here, else torch's AdamW on the host."""
    import deepspeed
    _deepspeed_comm()
    optimizer, which = None, "DeepSpeedCPUAdam"
    if offload and args.deepspeed_adam == "deepspeed":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, weight_decay=0.1, adamw_mode=True)
        except Exception as error:  # its C++ extension did not build (no CUDA toolkit on this image, say)
            which = f"torch AdamW (DeepSpeedCPUAdam: {type(error).__name__}: {str(error)[:160]})"
    if optimizer is None:
        optimizer = adamw(model.parameters(), args.fused)
        which = (which if which != "DeepSpeedCPUAdam" else "torch AdamW") + (" (fused)" if args.fused else "")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_config(args, stage, offload, micro_batch))
    return engine, which


def _deepspeed_comm() -> None:
    import deepspeed
    import torch.distributed as dist
    if getattr(_deepspeed_comm, "done", False):
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    deepspeed.init_distributed(dist_backend=dist.get_backend() if dist.is_initialized() else None)
    _deepspeed_comm.done = True


def memory(device: torch.device) -> dict[str, Any]:
    """The GPU's high-water mark (torch's allocator) and the process's peak RSS (/proc/self/status VmHWM)."""
    hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM"))
    gpu = torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None
    return {"gpu_peak_mib": gpu, "peak_rss_gib": hwm / GIB}


# --- the parts -------------------------------------------------------------------------------------------------

def run_child(args: argparse.Namespace, contender: str, accumulate: int, model: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "child", "--contender", contender, "--accumulate", str(accumulate),
               "--model", model, "--steps", str(args.steps), "--hidden", str(args.hidden),
               "--n-layer", str(args.n_layer), "--mlp-hidden", str(args.mlp_hidden), "--seq", str(args.seq),
               "--deepspeed-adam", args.deepspeed_adam, *(["--fused"] if args.fused else []),
               *(["--phases"] if args.phases else [])]
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=environment)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {args.timeout:.0f} s"}
    rows = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not rows:
        return {"error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"}
    return {**json.loads(rows[-1][len("RESULT "):]), "process_s": round(time.perf_counter() - started, 1)}


def batch(args: argparse.Namespace) -> dict[str, Any]:
    names = [name for name in (args.only.split(",") if args.only else BATCH_CONTENDERS) if name]
    rows: dict[str, Any] = {}
    for accumulate in [int(count) for count in args.accumulation.split(",")]:
        for name in names:
            if name.startswith("deepspeed") and not _imports("deepspeed"):
                continue
            rows[f"{name} x{accumulate}"] = row = run_child(args, name, accumulate, "gpt")
            print(f"{name:<22} accumulation {accumulate:>3}: {_line(row)}", flush=True)
    return rows


def largest(args: argparse.Namespace) -> dict[str, Any]:
    names = [name for name in (args.only.split(",") if args.only else LARGEST_CONTENDERS) if name]
    rows: dict[str, Any] = {}
    for name in names:
        if name.startswith("deepspeed") and not _imports("deepspeed"):
            continue
        rows[name] = row = run_child(args, name, 1, "llama")
        print(f"{name:<22} {_line(row)}", flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    if "step_s" not in row:
        return row.get("error", "?")[:300]
    phases = "".join(f"\n    {phase} {ms:,.1f} ms" for phase, ms in row.get("phase_ms", {}).items())
    return (f"trains {row['trains']}  step s {row['step_s']:.3f}  tokens/s {row['tokens_per_s']:,.0f}  GPU peak MiB "
            f"{row['gpu_peak_mib'] or 0:,.0f}  peak RSS GiB {row['peak_rss_gib']:.1f}  ({row['adam']}){phases}")


def _imports(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.part == "child":
        print("RESULT " + json.dumps(child(args)), flush=True)
        return {}
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    report = {"card": card, "torch": torch.__version__, "part": args.part,
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "rows": (batch if args.part == "batch" else largest)(args)}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
