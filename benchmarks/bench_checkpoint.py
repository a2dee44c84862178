"""Checkpoint save, load and training stall, zerokit beside its peers on the same model, data and ranks;
then offline consolidation, zerokit's beside DeepSpeed's zero_to_fp32.

    python benchmarks/bench_checkpoint.py                       # 2 gloo ranks, benchmarks/workload.py's GPT
    python benchmarks/bench_checkpoint.py --world-size 3 --stage 3 --rounds 3

Contenders, each on fresh ranks, after two training steps (so optimizer state exists):
- zerokit-sync: engine.save_checkpoint(dir); zerokit-async: save_checkpoint(dir, async_save=True), whose
  stall is the time until it returns (a copy into host buffers; the second save's, once the buffers
  exist) and whose save time is until zerokit.checkpoint.wait() returns (written and committed);
  zerokit-dcp: save_checkpoint(dir, format="dcp"), torch.distributed.checkpoint's files, loaded back by zerokit.
- deepspeed: DeepSpeedEngine.save_checkpoint / load_checkpoint at the same ZeRO stage (synchronous: its
  asynchronous writers need CUDA or external engines).
- dcp-fsdp2 / dcp-fsdp2-async: torch.distributed.checkpoint.save / async_save of FSDP2's model and
  optimizer state dicts (get_state_dict), load with dcp.load and set_state_dict.
Times are the slowest rank's, each after a barrier, the median over rounds; a save's peak memory is the largest
rank's peak RSS growth from the save's start to its end (VmHWM reset before it; for an asynchronous save, until the
background write is done). The load is into freshly
built ranks of the same world size. Consolidation runs in a fresh process on the saved checkpoints,
measuring time and peak RSS growth (VmHWM, reset after the imports), beside the largest tensor.

    python benchmarks/bench_checkpoint.py --deepspeed-import                 # 2 ranks; another size: 1
    python benchmarks/bench_checkpoint.py --deepspeed-import --other-world-size 3 --stage 2

--deepspeed-import measures bringing a DeepSpeed run over instead: real DeepSpeed trains two steps and saves at
the stage and world size given; then, each on freshly built ranks, (same world size) DeepSpeed resumes its own
checkpoint beside zerokit resuming it, and (--other-world-size) DeepSpeed's offline ds_to_universal followed by
its load_universal load beside zerokit resuming the DeepSpeed checkpoint directly. Per load: seconds (slowest
rank) and peak RSS growth during the load (VmHWM reset before it, the largest rank's); the conversion: seconds
and the peak RSS of its process (wait4's ru_maxrss, its worker processes included where it starts any).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.contenders import _deepspeed_comm  # noqa: E402
from benchmarks.workload import BenchSettings, make_batch, make_model, make_optimizer  # noqa: E402
from zerokit.testing.models import lm_loss  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

CONTENDERS = ("zerokit-sync", "zerokit-async", "zerokit-dcp", "deepspeed", "dcp-fsdp2", "dcp-fsdp2-async")


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes on the slowest rank, started together."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _peak_growth_from_here() -> Callable[[], float]:
    """Reset this rank's VmHWM to its RSS now; the returned call gives the largest rank's peak growth since."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    baseline = _rss("VmRSS")

    def growth() -> float:
        grown = torch.tensor([_rss("VmHWM") - baseline], dtype=torch.float64)
        dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        return grown.item()

    return growth


def _train(step_fn: Callable[[torch.Tensor], None], settings: BenchSettings, rank: int, steps: int = 2) -> None:
    for step in range(steps):
        step_fn(make_batch(settings, rank, step))


# --- the contenders: (save, stall, load) ---------------------------------------------------------------

def _zerokit(settings: BenchSettings, stage: int, directory: Path, rank: int, asynchronous: bool,
             format: str = "zerokit") -> dict:
    import zerokit

    def build():
        model = make_model(settings)
        return zerokit.initialize(model, make_optimizer(model, settings), {"zero_optimization": {"stage": stage}})

    engine = build()

    def step(tokens):
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()

    _train(step, settings, rank)
    out = {}
    if asynchronous:
        engine.save_checkpoint(directory, tag="warm", async_save=True)  # allocates the host buffers
        zerokit.checkpoint.wait(engine)
        peak = _peak_growth_from_here()
        out["stall_s"] = _timed(lambda: engine.save_checkpoint(directory, tag="t", async_save=True))
        out["save_s"] = out["stall_s"] + _timed(lambda: zerokit.checkpoint.wait(engine))
    else:
        peak = _peak_growth_from_here()
        out["save_s"] = out["stall_s"] = _timed(lambda: engine.save_checkpoint(directory, tag="t", format=format))
    out["save_peak"] = peak()
    fresh = build()
    out["load_s"] = _timed(lambda: fresh.load_checkpoint(directory, tag="t"))
    return out


def _deepspeed(settings: BenchSettings, stage: int, directory: Path, rank: int) -> dict:
    import deepspeed

    _deepspeed_comm()
    config = {"train_micro_batch_size_per_gpu": settings.batch_size, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0, "steps_per_print": 2**30}

    def build():
        model = make_model(settings)
        with contextlib.redirect_stdout(io.StringIO()):
            engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, settings), config=config)
        return engine

    engine = build()

    def step(tokens):
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()

    _train(step, settings, rank)
    with contextlib.redirect_stdout(io.StringIO()):
        peak = _peak_growth_from_here()
        save = _timed(lambda: engine.save_checkpoint(str(directory), tag="t"))
        save_peak = peak()
        fresh = build()
        load = _timed(lambda: fresh.load_checkpoint(str(directory), tag="t"))
    return {"save_s": save, "stall_s": save, "load_s": load, "save_peak": save_peak}


def _dcp_fsdp2(settings: BenchSettings, directory: Path, rank: int, asynchronous: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build():
        model = make_model(settings)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, make_optimizer(model, settings)

    model, optimizer = build()

    def step(tokens):
        lm_loss(model(tokens[:, :-1]), tokens).backward()
        optimizer.step()
        optimizer.zero_grad()

    _train(step, settings, rank)

    def state(m, o):
        model_state, optimizer_state = get_state_dict(m, o)
        return {"model": model_state, "optimizer": optimizer_state}

    out = {}
    if asynchronous:
        dcp.async_save(state(model, optimizer), checkpoint_id=str(directory / "warm")).result()
        future = []
        peak = _peak_growth_from_here()
        out["stall_s"] = _timed(lambda: future.append(dcp.async_save(state(model, optimizer),
                                                                    checkpoint_id=str(directory / "t"))))
        out["save_s"] = out["stall_s"] + _timed(lambda: future[0].result())
    else:
        peak = _peak_growth_from_here()
        out["save_s"] = out["stall_s"] = _timed(lambda: dcp.save(state(model, optimizer),
                                                                 checkpoint_id=str(directory / "t")))
    out["save_peak"] = peak()
    fresh_model, fresh_optimizer = build()

    def load():
        target = state(fresh_model, fresh_optimizer)
        dcp.load(target, checkpoint_id=str(directory / "t"))
        set_state_dict(fresh_model, fresh_optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])

    out["load_s"] = _timed(load)
    return out


def run_contender(rank: int, world_size: int, name: str, settings: BenchSettings, stage: int, root: str) -> dict:
    directory = Path(root) / name
    if name.startswith("zerokit"):
        return _zerokit(settings, stage, directory, rank, name.endswith("async"), "dcp" if name.endswith("dcp") else
                        "zerokit")
    if name == "deepspeed":
        return _deepspeed(settings, stage, directory, rank)
    return _dcp_fsdp2(settings, directory, rank, name.endswith("async"))


# --- a DeepSpeed run brought over: DeepSpeed's resume, ds_to_universal + load_universal, zerokit's -------

def _rss(key: str) -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1]) * 1024


def _measured_load(load: Callable[[], Any]) -> dict:
    """Seconds (slowest rank) and peak RSS growth (largest rank) of `load`."""
    peak = _peak_growth_from_here()
    seconds = _timed(load)
    return {"load_s": seconds, "peak_growth": peak()}


def _deepspeed_config(settings: BenchSettings, stage: int, universal: bool = False) -> dict:
    config = {"train_micro_batch_size_per_gpu": settings.batch_size, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0, "steps_per_print": 2**30}
    return {**config, "checkpoint": {"load_universal": True}} if universal else config


def _deepspeed_engine(settings: BenchSettings, stage: int, universal: bool = False):
    import deepspeed

    model = make_model(settings)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, settings),
                                          config=_deepspeed_config(settings, stage, universal))
    return engine


def deepspeed_save(rank: int, world_size: int, settings: BenchSettings, stage: int, root: str) -> None:
    """Real DeepSpeed trains two steps and saves root/ds, tag t."""
    _deepspeed_comm()
    engine = _deepspeed_engine(settings, stage)

    def step(tokens):
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()

    _train(step, settings, rank)
    with contextlib.redirect_stdout(io.StringIO()):
        engine.save_checkpoint(str(Path(root) / "ds"), tag="t")
    dist.barrier()


def resume_deepspeed_run(rank: int, world_size: int, who: str, settings: BenchSettings, stage: int,
                         root: str) -> dict:
    """One load of root/ds into fresh ranks: `deepspeed` (its own checkpoint), `deepspeed-universal` (root/ds's
    universal conversion, tag t_universal) or `zerokit` (the DeepSpeed checkpoint itself)."""
    settings = replace(settings, world_size=world_size)
    if who == "zerokit":
        import zerokit

        model = make_model(settings)
        engine = zerokit.initialize(model, make_optimizer(model, settings), {"zero_optimization": {"stage": stage}})
        return _measured_load(lambda: engine.load_checkpoint(Path(root) / "ds", tag="t"))
    _deepspeed_comm()
    engine = _deepspeed_engine(settings, stage, universal=who == "deepspeed-universal")
    tag = "t_universal" if who == "deepspeed-universal" else "t"
    with contextlib.redirect_stdout(io.StringIO()):
        return _measured_load(lambda: engine.load_checkpoint(str(Path(root) / "ds"), tag=tag))


def ds_to_universal(root: Path) -> dict:
    """DeepSpeed's offline conversion of root/ds/t to root/ds/t_universal: seconds and the process's peak RSS."""
    converter = Path(importlib.util.find_spec("deepspeed.checkpoint.ds_to_universal").origin)
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, str(converter), "--input_folder", str(root / "ds" / "t"),
                                "--output_folder", str(root / "ds" / "t_universal"), "--num_extract_workers", "1",
                                "--num_merge_workers", "1", "--inject_missing_state"],  # stages 1-2 lack universal_checkpoint_info
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status:
        return {"error": process.stderr.read().decode().strip().splitlines()[-1]}
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024}


def deepspeed_import(args: argparse.Namespace, settings: BenchSettings) -> dict:
    rows: dict[str, list[dict]] = {"deepspeed": [], "zerokit": [], "deepspeed-universal": [], "zerokit-other": []}
    with tempfile.TemporaryDirectory(prefix="zerokit-bench-dsimport-") as root:
        spawn(deepspeed_save, args.world_size, settings, args.stage, root)
        conversion = ds_to_universal(Path(root))
        for round_index in range(args.rounds):
            order = list(rows) if round_index % 2 == 0 else list(rows)[::-1]
            for name in order:
                who, size = name.removesuffix("-other"), args.world_size
                if name in ("deepspeed-universal", "zerokit-other"):
                    size = args.other_world_size
                if who == "deepspeed-universal" and "error" in conversion:
                    continue
                rows[name].append(spawn(resume_deepspeed_run, size, who, settings, args.stage, root)[0])
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in ("load_s", "peak_growth")}
               for name, runs in rows.items() if runs}
    params = sum(p.numel() for p in make_model(settings).parameters())
    print(f"{params / 1e6:.1f}M parameters (fp32, AdamW), DeepSpeed ZeRO stage {args.stage} checkpoint saved on "
          f"{args.world_size} gloo ranks, median of {args.rounds} rounds")
    print(f"{'resume':44} {'ranks':>5} {'load s':>8} {'peak RSS growth MiB':>20}")
    labels = {"deepspeed": "DeepSpeed load_checkpoint (its own)", "zerokit": "zerokit load_checkpoint (DeepSpeed's)",
              "deepspeed-universal": "DeepSpeed load_universal (after conversion)",
              "zerokit-other": "zerokit load_checkpoint (DeepSpeed's)"}
    for name, row in summary.items():
        size = args.other_world_size if name in ("deepspeed-universal", "zerokit-other") else args.world_size
        print(f"{labels[name]:44} {size:5d} {row['load_s']:8.3f} {row['peak_growth'] / 2**20:20.1f}")
    if "error" in conversion:
        print(f"ds_to_universal failed: {conversion['error']}")
    else:
        print(f"ds_to_universal (offline, before load_universal): {conversion['seconds']:.2f} s, peak RSS "
              f"{conversion['peak_rss'] / 2**20:.1f} MiB")
    return {"settings": settings.as_dict(), "stage": args.stage, "world_size": args.world_size,
            "other_world_size": args.other_world_size, "rounds": rows, "median": summary, "ds_to_universal": conversion}


# --- consolidation, in a fresh process ---------------------------------------------------------------

MEASURE = """
import gc, json, sys, time
from pathlib import Path
import torch
{imports}
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
status = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
baseline, start = status("VmRSS"), time.perf_counter()
{call}
print(json.dumps({{"seconds": time.perf_counter() - start, "peak_growth": status("VmHWM") - baseline}}))
"""


def consolidate_in_process(imports: str, call: str) -> dict:
    run = subprocess.run([sys.executable, "-c", MEASURE.format(imports=imports, call=call)], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parent.parent)
    if run.returncode:
        return {"error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "failed"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def consolidation(root: Path, out: Path) -> dict[str, dict]:
    results = {"zerokit consolidate": consolidate_in_process(
        "import zerokit.checkpoint as c",
        f"c.consolidate({str(root / 'zerokit-sync')!r}, {str(out / 'zk.safetensors')!r}, tag='t')")}
    if (root / "deepspeed").exists():
        results["deepspeed zero_to_fp32"] = consolidate_in_process(
            "import contextlib, io\nfrom deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict",
            f"with contextlib.redirect_stdout(io.StringIO()):\n    convert_zero_checkpoint_to_fp32_state_dict("
            f"{str(root / 'deepspeed')!r}, {str(out / 'ds')!r}, tag='t', safe_serialization=True)")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(CONTENDERS))
    parser.add_argument("--n-layer", type=int, default=BenchSettings().n_layer)
    parser.add_argument("--n-embd", type=int, default=BenchSettings().n_embd)
    parser.add_argument("--out", default="bench_results/bench_checkpoint.json")
    parser.add_argument("--deepspeed-import", action="store_true",
                        help="measure resuming a DeepSpeed checkpoint instead (See the module's docstring)")
    parser.add_argument("--other-world-size", type=int, default=1)
    args = parser.parse_args(argv)
    settings = BenchSettings(world_size=args.world_size, n_layer=args.n_layer, n_embd=args.n_embd)
    if args.deepspeed_import:
        results = deepspeed_import(args, settings)
        out = Path(args.out).with_name(Path(args.out).stem + "_deepspeed_import.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        return 0
    names = [n for n in args.only.split(",") if n]
    rows: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="zerokit-bench-ckpt-") as root:
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]  # a drifting load weighs on all alike
            for name in order:
                rows[name].append(spawn(run_contender, args.world_size, name, settings, args.stage, root)[0])
        consolidated = consolidation(Path(root), Path(root) / "consolidated")
    model = make_model(settings)
    largest = max(p.numel() * 4 for p in model.parameters())
    summary = {name: {key: statistics.median(r[key] for r in runs)
                      for key in ("save_s", "stall_s", "load_s", "save_peak")}
               for name, runs in rows.items()}
    report(summary, consolidated, largest, settings, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": settings.as_dict(), "stage": args.stage, "rounds": rows,
                                          "median": summary, "consolidation": consolidated,
                                          "largest_tensor_bytes": largest}, indent=2))
    return 0


def report(summary: dict, consolidated: dict, largest: int, settings: BenchSettings, args: argparse.Namespace) -> None:
    params = sum(p.numel() for p in make_model(settings).parameters())
    print(f"{params / 1e6:.1f}M parameters (fp32, AdamW), {args.world_size} gloo ranks, ZeRO stage {args.stage}, "
          f"median of {args.rounds} rounds; slowest rank")
    peers = [n for n in summary if not n.startswith("zerokit")]
    print(f"{'contender':18} {'save s':>8} {'stall s':>8} {'load s':>8} {'save peak MiB':>14}")
    for name, row in summary.items():
        print(f"{name:18} {row['save_s']:8.3f} {row['stall_s']:8.3f} {row['load_s']:8.3f} "
              f"{row['save_peak'] / 2**20:14.1f}")
    if peers:
        for name in (n for n in summary if n.startswith("zerokit")):
            best_stall = min(summary[p]["stall_s"] for p in peers)
            best_load = min(summary[p]["load_s"] for p in peers)
            print(f"{name}: stall {summary[name]['stall_s'] / best_stall:.2f}x the fastest peer's, "
                  f"load {summary[name]['load_s'] / best_load:.2f}x")
    print(f"consolidation (largest tensor {largest / 2**20:.1f} MiB):")
    for name, row in consolidated.items():
        if "error" in row:
            print(f"  {name:24} failed: {row['error']}")
        else:
            print(f"  {name:24} {row['seconds']:7.2f} s   peak RSS growth {row['peak_growth'] / 2**20:8.1f} MiB "
                  f"({row['peak_growth'] / largest:.2f}x the largest tensor)")


if __name__ == "__main__":
    sys.exit(main())
