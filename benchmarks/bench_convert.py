"""The way back, measured: `zerokit convert SRC OUT --to deepspeed-universal` beside DeepSpeed's own
ds_to_universal.py, each converting a checkpoint of the same model (benchmarks/workload.py's GPT, fp32, AdamW)
saved after two training steps at the same ZeRO stage and world size.

    python benchmarks/bench_convert.py                        # 2 gloo ranks, stage 2, the default GPT
    python benchmarks/bench_convert.py --stage 3 --n-layer 12 --rounds 3

Each conversion runs in a fresh process: seconds (wall, start to exit) and that process's peak RSS (wait4's
ru_maxrss). ds_to_universal runs with one extract and one merge worker, so its work stays in the measured process
(its defaults, 4 and 2 worker processes, spread the same work over processes wait4 does not count). The floor of
each, the same process importing its converter and doing nothing else, is reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.contenders import _deepspeed_comm  # noqa: E402
from benchmarks.workload import BenchSettings, make_batch, make_model, make_optimizer  # noqa: E402
from zerokit.testing.models import lm_loss  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _train(engine, settings: BenchSettings, rank: int, steps: int = 2) -> None:
    for step in range(steps):
        tokens = make_batch(settings, rank, step)
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()


def zerokit_save(rank: int, world_size: int, settings: BenchSettings, stage: int, root: str) -> None:
    """zerokit trains two steps and saves root/zk, tag t."""
    import zerokit

    model = make_model(settings)
    engine = zerokit.initialize(model, make_optimizer(model, settings), {"zero_optimization": {"stage": stage}})
    _train(engine, settings, rank)
    engine.save_checkpoint(Path(root) / "zk", tag="t")
    engine.close()


def deepspeed_save(rank: int, world_size: int, settings: BenchSettings, stage: int, root: str) -> None:
    """Real DeepSpeed trains two steps and saves root/ds, tag t."""
    import deepspeed

    _deepspeed_comm()
    model = make_model(settings)
    config = {"train_micro_batch_size_per_gpu": settings.batch_size, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0, "steps_per_print": 2**30}
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, settings), config=config)
        _train(engine, settings, rank)
        engine.save_checkpoint(str(Path(root) / "ds"), tag="t")
    dist.barrier()


def measured(command: list[str]) -> dict:
    """Seconds and peak RSS of `command`, run in a fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status:
        raise RuntimeError(f"{' '.join(command)} failed: {process.stderr.read().decode().strip().splitlines()[-1]}")
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024}


def commands(root: Path, round_: int) -> dict[str, tuple[list[str], list[str]]]:
    """Per converter: (the conversion, its floor: the same interpreter importing the converter only)."""
    converter = Path(importlib.util.find_spec("deepspeed.checkpoint.ds_to_universal").origin)
    python = sys.executable
    return {
        "zerokit convert": (
            [python, "-m", "zerokit", "convert", str(root / "zk"), str(root / f"zk_universal{round_}"),
             "--tag", "t", "--to", "deepspeed-universal"],
            [python, "-c", "import zerokit.cli, zerokit.checkpoint.deepspeed_export"]),
        "deepspeed ds_to_universal": (
            [python, str(converter), "--input_folder", str(root / "ds" / "t"), "--output_folder",
             str(root / f"ds_universal{round_}" / "t_universal"), "--num_extract_workers", "1",
             "--num_merge_workers", "1", "--inject_missing_state"],
            [python, "-c", "import deepspeed.checkpoint.ds_to_universal"]),
    }


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--n-layer", type=int, default=BenchSettings.n_layer)
    parser.add_argument("--n-embd", type=int, default=BenchSettings.n_embd)
    parser.add_argument("--rounds", type=int, default=3, help="conversions per converter; the median is reported")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("deepspeed") is None:
        parser.exit(2, "bench_convert: deepspeed is not installed; it is the comparison\n")
    settings = BenchSettings(world_size=args.world_size, n_layer=args.n_layer, n_embd=args.n_embd)
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as directory:
        root = Path(directory)
        spawn(zerokit_save, args.world_size, settings, args.stage, str(root), timeout=600)
        spawn(deepspeed_save, args.world_size, settings, args.stage, str(root), timeout=600)
        params = sum(p.numel() for p in make_model(settings).parameters())
        print(f"model: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:,.0f} MiB fp32), saved by {args.world_size} "
              f"ranks at stage {args.stage}: zerokit {directory_bytes(root / 'zk') / 2**20:,.0f} MiB, DeepSpeed "
              f"{directory_bytes(root / 'ds') / 2**20:,.0f} MiB")
        print(f"load average before the conversions: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
              "(others' work on a shared machine slows both converters alike)")
        print(f"{'converter':<28}{'seconds':>9}{'peak RSS MiB':>14}{'floor s':>9}{'floor MiB':>11}{'written MiB':>13}")
        runs: dict[str, list[dict]] = {name: [] for name in commands(root, 0)}
        floors: dict[str, list[dict]] = {name: [] for name in runs}
        for round_ in range(args.rounds):  # the converters take turns, so a change in others' load hits both
            for name, (conversion, floor) in commands(root, round_).items():
                runs[name].append(measured(conversion))
                floors[name].append(measured(floor))
        for name in runs:
            written = directory_bytes(root / ("zk_universal0" if name.startswith("zerokit") else "ds_universal0"))
            print(f"{name:<28}{statistics.median(r['seconds'] for r in runs[name]):>9.2f}"
                  f"{statistics.median(r['peak_rss'] for r in runs[name]) / 2**20:>14,.0f}"
                  f"{statistics.median(f['seconds'] for f in floors[name]):>9.2f}"
                  f"{statistics.median(f['peak_rss'] for f in floors[name]) / 2**20:>11,.0f}{written / 2**20:>13,.0f}")
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
