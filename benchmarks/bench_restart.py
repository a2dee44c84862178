"""What a preemption and a save that dies cost a job under torchrun (issue 33, items 4 and 5; docs/reliability.md):
tests/scripts/restart_job.py (a stage-2 TinyGPT on 2 gloo ranks, 10 steps, a save every 4) launched as the tests
launch it, timed.

    python benchmarks/bench_restart.py --rounds 3

Per round:
  - preemption: SIGUSR1 to rank 1 inside step 5, with --max-restarts 0; seconds from the signal, all watched from
    outside the ranks (psutil, polling every 2 ms): to `latest` naming the saved step, to each rank's process ending,
    to torchrun's; the preemption save alone (rank 0's log line), the rank exit codes torchrun reports, and, for
    comparison, the same job left to finish: seconds from its last step (rank 0's result written) to each rank's
    process ending. Then the same preemption with --max-restarts 1: seconds from the signal to the end of the first
    step of the job torchrun restarts; and, for what the interpreter's end costs with torch loaded, one process (a
    gloo group of one) that trains a step of a Linear with AdamW under torch DDP, and under zerokit: seconds from its
    last line to the process's end, watched from outside;
  - killed save: every rank SIGKILLed half-way through its rank file in the save after step 8, then rank 0 inside
    the commit of the next try; seconds from the last kill to the end of the first resumed step;
  - full disk: the save after step 8 finds a full tmpfs (root) or a file-size limit (else); seconds it took to fail
    on every rank;
  - the check at each window's end: with 2 ranks spawned, --steps optimizer steps with preemption on and off,
    alternated on one engine, and the check alone (one all-reduce of a scalar), the median of 200 calls.

    python benchmarks/bench_restart.py --random 20 --seed 1

SIGTERM to torchrun at a random time (2-9 s after the launch) of a 150-step job with preemption on that saves every
50 steps, launched again until it finishes, 20 times: each trial's rank exit codes, the checkpoint `latest` named,
the step the job resumed from, and whether it ended with the weights of the job never preempted, bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zerokit  # noqa: E402
from zerokit.precision import StepResult  # noqa: E402
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups  # noqa: E402
from zerokit.testing.spawn import spawn  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "restart_job.py"


def torchrun(out: Path, *args: str, restarts: int = 1) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", str(restarts), str(SCRIPT), "--out", str(out), *args]


def _ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _watch(job: subprocess.Popen, since: float, marks: dict[str, Callable[[], bool]]) -> dict[str, float]:
    """Seconds from `since` to each mark's first truth and to each rank's process ending, polled from outside until
    torchrun ends (`torchrun`)."""
    ranks = psutil.Process(job.pid).children()
    seen: dict[str, float] = {}
    while job.poll() is None:
        now = time.time()
        for name, reached in marks.items():
            if name not in seen and reached():
                seen[name] = now - since
        for index, rank in enumerate(ranks):
            if f"process_{index}" not in seen and _ended(rank):
                seen[f"process_{index}"] = now - since
        time.sleep(0.002)
    seen["torchrun"] = time.time() - since
    return {name: round(value, 3) for name, value in seen.items()}


def _launch(out: Path, *args: str, restarts: int) -> subprocess.Popen:
    """torchrun in the background, its output in OUT/torchrun.log (a pipe nobody reads while polling could fill)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "torchrun.log", "w") as log:
        return subprocess.Popen(torchrun(out, *args, restarts=restarts), stdout=log, stderr=subprocess.STDOUT)


def _signal_rank_1_inside_step_5(out: Path, restarts: int) -> tuple[subprocess.Popen, float]:
    job = _launch(out, "--preempt-at", "5", restarts=restarts)
    while not (out / "in_step").exists() and job.poll() is None:
        time.sleep(0.01)
    time.sleep(0.05)
    sent = time.time()
    (out / "killed_at").write_text(repr(sent))
    os.kill(int((out / "in_step").read_text()), signal.SIGUSR1)
    return job, sent


def preemption_round(out: Path) -> dict:
    latest = out / "checkpoints" / "latest"
    job, sent = _signal_rank_1_inside_step_5(out, restarts=0)
    seen = _watch(job, sent, {"saved": lambda: latest.exists() and latest.read_text() == "global_step6"})
    stderr = (out / "torchrun.log").read_text()
    saved = re.search(r"saved optimizer step \d+ in \S+ in ([\d.]+) s", stderr)
    codes = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    figures = {"signal_to_saved_s": seen.get("saved"),
               "signal_to_process_exit_s": sorted(seen[name] for name in seen if name.startswith("process_")),
               "signal_to_torchrun_exit_s": seen["torchrun"],
               "preemption_save_s": float(saved.group(1)) if saved else None,
               "torchrun_exit_codes": {int(rank): int(code) for rank, code in codes}}
    finished = out / "finished"
    job = _launch(finished, restarts=0)
    while not (finished / "result.json").exists() and job.poll() is None:
        time.sleep(0.002)
    seen = _watch(job, time.time(), {})
    figures["normal_end_to_process_exit_s"] = sorted(seen[name] for name in seen if name.startswith("process_"))
    restarted = out / "restarted"
    job, _ = _signal_rank_1_inside_step_5(restarted, restarts=1)
    job.wait(timeout=300)
    result = json.loads((restarted / "result.json").read_text())
    figures["signal_to_first_resumed_step_s"] = round(result["seconds_from_kill_to_first_resumed_step"], 3)
    figures["resumed_from"] = result["resumed_from"]
    figures["teardown_s"] = {peer: teardown_round(peer) for peer in ("ddp", "zerokit")}
    return figures


TEARDOWN_JOB = """
import os, sys, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
model = torch.nn.Linear(64, 64)
if sys.argv[1] == "ddp":
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters())
    ddp(torch.randn(2, 64)).sum().backward()
    optimizer.step()
else:
    import zerokit
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(2, 64)).sum())
    engine.step()
print(repr(time.time()), flush=True)
"""


def teardown_round(peer: str) -> float:
    """Seconds from TEARDOWN_JOB's last line to its process's end (the interpreter's end with torch loaded)."""
    job = subprocess.Popen([sys.executable, "-c", TEARDOWN_JOB, peer, str(29400 + random.randrange(500))],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    last_line = float(job.stdout.readline())
    while not _ended(psutil.Process(job.pid)):
        time.sleep(0.002)
    ended = time.time()
    job.wait()
    return round(ended - last_line, 3)


def killed_save_round(out: Path) -> dict:
    subprocess.run(torchrun(out, "--tag", "last", "--kill-in-save", "rank-file", "commit", restarts=2),
                   capture_output=True, check=True, timeout=300)
    result = json.loads((out / "result.json").read_text())
    return {"kill_to_first_resumed_step_s": round(result["seconds_from_kill_to_first_resumed_step"], 3),
            "starts": (out / "starts").read_text().split("\n")[:-1]}


def full_disk_round(out: Path) -> dict:
    disk = out / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    try:
        subprocess.run(torchrun(out, "--checkpoints", str(disk / "checkpoints"), "--full-disk-at", "8", "--starve",
                                "fill" if mounted else "fsize"), capture_output=True, check=True, timeout=300)
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)
    seconds = [float((out / f"save_error_seconds_rank{rank}.txt").read_text()) for rank in (0, 1)]
    return {"failed_save_s": seconds, "disk": "tmpfs" if mounted else "RLIMIT_FSIZE"}


RANDOM_JOB = ("--steps", "150", "--save-every", "50", "--preempt-at", "100000")  # preemption on, no wait


def random_trials(trials: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="zerokit-bench-restart-") as root:
        reference = Path(root) / "reference"
        reference.mkdir()
        subprocess.run(torchrun(reference, *RANDOM_JOB, restarts=0), capture_output=True, check=True, timeout=300)
        expected = json.loads((reference / "result.json").read_text())["weights"]
        rows = []
        for trial in range(trials):
            out = Path(root) / f"trial{trial}"
            out.mkdir()
            rows.append(_random_trial(out, rng.uniform(2.0, 9.0), expected))
            print("random", json.dumps(rows[-1]), flush=True)
    return rows


def _random_trial(out: Path, delay: float, expected: dict) -> dict:
    job = subprocess.Popen(torchrun(out, *RANDOM_JOB, restarts=0), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(delay)
    os.kill(job.pid, signal.SIGTERM)
    job.communicate(timeout=300)
    codes = [json.loads(p.read_text())["code"] for p in sorted(out.glob("exit_rank*"))]
    latest = out / "checkpoints" / "latest"
    saved = latest.read_text() if latest.exists() else None
    launches = 1
    while not (out / "result.json").exists() and launches < 4:  # requeued
        subprocess.run(torchrun(out, *RANDOM_JOB, restarts=0), capture_output=True, timeout=300)
        launches += 1
    result = json.loads((out / "result.json").read_text())
    return {"sigterm_after_s": round(delay, 2), "exit_codes": codes, "latest_then": saved,
            "resumed_from": result["resumed_from"], "launches": launches, "bit_equal": result["weights"] == expected}


def _check_cost(rank: int, world_size: int, steps: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2),
                                {"zero_optimization": {"stage": 2},
                                 "preemption": {"enabled": True, "save_dir": tempfile.gettempdir()}})
    policy = engine.preemption.policy
    arms: dict[str, list[float]] = {"on": [], "off": []}
    for round_index in range(rounds):
        for arm in (("on", "off") if round_index % 2 == 0 else ("off", "on")):
            engine.preemption.policy = dataclasses.replace(policy, enabled=arm == "on")
            torch.distributed.barrier()
            began = time.perf_counter()
            for step in range(steps):
                tokens = torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(1000 * step + rank))
                engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
                engine.step()
            arms[arm].append(time.perf_counter() - began)
    engine.preemption.policy = policy
    boundary = StepResult(micro_step=1, optimizer_step=1, boundary=True, stepped=True, skipped=False, loss_scale=1.0,
                          grad_norm=1.0, clipped=False, consecutive_skips=0, total_skips=0)
    calls = []
    for _ in range(200):
        began = time.perf_counter()
        engine.preemption.after_step(boundary)
        calls.append(time.perf_counter() - began)
    engine.close()
    return {"step_s_on": [round(s / steps, 5) for s in arms["on"]],
            "step_s_off": [round(s / steps, 5) for s in arms["off"]],
            "check_ms_median": round(statistics.median(calls) * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("--random", type=int, default=0, help="instead: this many SIGTERMs at random times")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.random:
        rows = random_trials(args.random, args.seed)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return 0 if all(row["bit_equal"] for row in rows) else 1
    figures: dict[str, list] = {"preemption": [], "killed_save": [], "full_disk": []}
    for _ in range(args.rounds):
        for name, measure in (("preemption", preemption_round), ("killed_save", killed_save_round),
                              ("full_disk", full_disk_round)):
            with tempfile.TemporaryDirectory(prefix="zerokit-bench-restart-") as out:
                figures[name].append(measure(Path(out)))
                print(name, json.dumps(figures[name][-1]), flush=True)
    figures["check"] = spawn(_check_cost, 2, args.steps, 2 * args.rounds, timeout=600)
    print("check", json.dumps(figures["check"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
