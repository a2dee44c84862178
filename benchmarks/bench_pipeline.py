"""zerokit's pipeline at ZeRO-1/2/3 beside DeepSpeed's PipelineModule (ZeRO-1) and torch pipelining + FSDP2
(benchmarks/torch_pipe_fsdp.py), on 4 CPU ranks (2 stages x 2
replicas, gloo), the same script (tests/scripts/ds_pipe.py), model, data and config: step time (median of the
steps after the first two), peak RSS per rank (the process's ru_maxrss), and the bytes each rank sends across the
simulated nodes per step (2 ranks a node: a stage is a node): zerokit's from its own counts (the activations and
gradients its pipeline stage sends, and its collectives that cross: the norm and loss scalars), the peers' from
benchmarks/wire_count, which counts torch.distributed's sends and collectives in their processes by the same
convention (start-up included, spread over the steps).

    python benchmarks/bench_pipeline.py [--steps 8] [--out docs/pipeline_bench.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(ROOT / "tests"))


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": stage},
            "steps_per_print": 1000, "ranks_per_node": 2}


def run(script: Path, stage: int, steps: int, directory: Path, zerokit: bool) -> list[dict]:
    settings = config(stage)
    if not zerokit:
        settings.pop("ranks_per_node")
    path = directory / f"{script.stem}-{stage}.json"
    path.write_text(json.dumps(settings))
    out = directory / f"out-{script.stem}-{stage}"
    return launch(script, ["--deepspeed_config", str(path), "--steps", str(steps), "--out", str(out)], out,
                  counted=not zerokit)


def run_torch(steps: int, directory: Path) -> list[dict]:
    """benchmarks/torch_pipe_fsdp.py: the same layers, cut the same way, each stage under FSDP2 (its own seed and
    initialisation: its loss is not comparable to the others', and it clips each stage by its own norm)."""
    out = directory / "out-torch"
    return launch(ROOT / "benchmarks" / "torch_pipe_fsdp.py", ["--steps", str(steps), "--out", str(out)], out,
                  counted=True)


def launch(script: Path, arguments: list[str], out: Path, counted: bool) -> list[dict]:
    """`script` on 4 ranks under torchrun; each rank's result, with a peer's bytes across nodes (`counted`: by
    benchmarks/wire_count in its processes) as "wire"."""
    paths = [str(SCRIPTS), str(ROOT)] + ([str(ROOT / "benchmarks" / "wire_count")] if counted else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    if counted:
        env.update(ZEROKIT_WIRE_OUT=str(out / "wire"), ZEROKIT_WIRE_RANKS_PER_NODE="2")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(script),
               *arguments]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]
    for rank, result in enumerate(ranks):
        wire = out / "wire" / f"rank{rank}.json"
        result["wire"] = json.loads(wire.read_text())["bytes"] if counted and wire.is_file() else 0
    return ranks


def row(name: str, ranks: list[dict]) -> str:
    step = statistics.median(s for r in ranks for s in r["step_seconds"][2:])
    rss = max(r["peak_rss_mib"] for r in ranks)
    if ranks[0]["comm"] is None:  # a peer: counted in its processes (benchmarks/wire_count)
        sent = [r["wire"] / len(r["step_seconds"]) for r in ranks]
    else:
        sent = [(r["comm"]["pipeline_sends"]["bytes"] + r["comm"].get("cross_node", {}).get("bytes", 0))
                / len(r["step_seconds"]) for r in ranks]
    across = f"{sum(sent) / len(sent) / 2**10:.1f}"
    return f"| {name} | {step * 1000:.0f} | {rss:.0f} | {across} | {ranks[-1]['losses'][-1]:.6f} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from test_deepspeed_scripts import switch_imports
    lines = ["| run | step ms (median) | peak RSS MiB (max rank) | KiB sent across nodes / rank / step | last loss |",
             "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        switched = directory / "ds_pipe_zerokit.py"
        switched.write_text(switch_imports((SCRIPTS / "ds_pipe.py").read_text()))
        lines.append(row("DeepSpeed 0.19.8 PipelineModule, ZeRO-1", run(SCRIPTS / "ds_pipe.py", 1, args.steps,
                                                                          directory, zerokit=False)))
        for stage in (1, 2, 3):
            lines.append(row(f"zerokit pipeline, ZeRO-{stage}", run(switched, stage, args.steps, directory, True)))
        lines.append(row("torch pipelining (Schedule1F1B) + FSDP2", run_torch(args.steps, directory)))
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
