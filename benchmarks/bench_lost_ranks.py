"""What a rank that dies or freezes, and a node lost for good, cost a job under torchrun (issue 33, items 2 and 6;
docs/reliability.md): the launches of tests/test_restart_ranks.py, timed.

    python benchmarks/bench_lost_ranks.py --rounds 3

Per round:
  - two nodes (two torchrun agents of one rank each, static rendezvous, `--max-restarts 1`): rank 1 SIGKILLs itself
    after step 7; seconds from the kill to rank 0's error (naming rank 1) and to the end of the first step of the
    restarted job. Then, in that job, rank 1 SIGSTOPs itself after step 6: seconds from the stop to rank 0's error
    (comm_timeout_seconds 2); this script then kills the frozen rank;
  - one node (`torchrun --standalone --nproc_per_node 2 --max-restarts 1`), rank 1 SIGSTOPped after step 7 with
    comm_timeout_seconds 5: seconds to rank 0's error and to the end of the first step of the job torchrun restarts,
    which waits for the frozen rank to die of its SIGTERM and SIGKILLs it 30 s later;
  - a node lost for good: tests/scripts/resize_job.py (the elasticity block, a global batch of 12) on 3 ranks, rank 2
    SIGKILLed after step 7, launched again on 2 ranks: steps trained again, and seconds from that launch to the end
    of its first step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "scripts"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _events(out: Path) -> dict[str, float]:
    return {what: float(when) for what, when in (line.rsplit(" ", 1) for line in (out / "events").read_text().splitlines())}


def _error_time(out: Path, attempt: int) -> float:
    return json.loads((out / f"comm_error_rank0_attempt{attempt}.json").read_text())["time"]


def two_nodes_round(out: Path) -> dict:
    port, args = _free_port(), ["--kill-at", "7", "--stop-at", "7", "--stop-in-attempt", "1", "--comm-timeout", "2"]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "--max-restarts", "1", str(SCRIPTS / "restart_job.py"), "--out", str(out), *args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for node in (0, 1)]
    frozen = out / "comm_error_rank0_attempt1.json"
    while not frozen.exists() and all(node.poll() is None for node in nodes):
        time.sleep(0.05)
    if frozen.exists():
        os.kill(int((out / "stopped").read_text()), signal.SIGKILL)
    for node in nodes:
        node.wait(timeout=300)
    times = _events(out)
    return {"kill_to_error_s": _error_time(out, 0) - times["killed 0"],
            "kill_to_first_resumed_step_s": times["first_step 1"] - times["killed 0"],
            "stop_to_error_s": _error_time(out, 1) - times["killed 1"]}


def one_node_frozen_round(out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--max-restarts", "1", str(SCRIPTS / "restart_job.py"), "--out", str(out), "--stop-at",
                           "7", "--comm-timeout", "5"], capture_output=True, text=True, timeout=300)
    times = _events(out)
    return {"ok": done.returncode == 0, "stop_to_error_s": _error_time(out, 0) - times["killed 0"],
            "stop_to_first_resumed_step_s": times["first_step 1"] - times["killed 0"]}


def lost_node_round(out: Path) -> dict:
    def launch(ranks: int, *args: str) -> None:
        (out / "launched_at").write_text(repr(time.time()))
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                        str(SCRIPTS / "resize_job.py"), "--out", str(out), *args], capture_output=True, timeout=300)
    launch(3, "--kill-at", "7")
    launch(2)
    result = json.loads((out / "result_2.json").read_text())
    return {"steps_trained_again": 7 - result["resumed_from"], "launch_to_first_step_s": result["seconds_to_first_step"],
            "batch_at_2": result["batch"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as scratch:
            parts = {name: Path(scratch) / name for name in ("two_nodes", "one_node_frozen", "lost_node")}
            for path in parts.values():
                path.mkdir()
            rounds.append({"two_nodes": two_nodes_round(parts["two_nodes"]),
                           "one_node_frozen": one_node_frozen_round(parts["one_node_frozen"]),
                           "lost_node": lost_node_round(parts["lost_node"])})
        print(json.dumps(rounds[-1]), flush=True)
    figures = {f"{part}.{key}": [round(r[part][key], 2) for r in rounds] for part in rounds[0]
               for key, value in rounds[0][part].items() if isinstance(value, float)}
    print(json.dumps({name: {"min": min(v), "median": statistics.median(v), "max": max(v)}
                      for name, v in figures.items()}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": rounds, "figures": figures}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
