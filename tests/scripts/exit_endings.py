"""Training scripts that end as most scripts end, run many times over (tests/test_exit.py).

Each run is two gloo ranks forked from this process (torch and zerokit are imported once, so a run costs what its
training and its exit cost, not two interpreters' start-up). A rank trains three steps of the small language model
of common.py at the given stage, through zerokit.initialize or zerokit.deepspeed.initialize, keeps its engine in a
module global as a script does, and then ends:
  destroy: dist.destroy_process_group() with the engine still referenced (DeepSpeed's and FSDP's scripts)
  none:    nothing at all (most examples)
and then really exits: the forked rank returns to the end of this module and the interpreter finalizes as a
script's does. The parent records how each rank ended (exit status or signal, and its stderr), and how many of
gloo's threads (pt_gloo_runloop, gloo_tcp_loop) were still alive when the interpreter began to finalize (an
atexit hook registered before zerokit's, so it runs after it). See [Note: leaving at exit] in zerokit/comm/process.py.

    python exit_endings.py --stage 2 3 --ending destroy none --runs 8 --out results.json   # runs of each pair
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import SEQUENCE, VOCAB, build_model  # noqa: E402

import zerokit  # noqa: E402
import zerokit.deepspeed  # noqa: E402

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
RANK_TIMEOUT = 120.0  # seconds a run may take before its ranks are killed (a hang is reported, not waited on)
STAGE3_UNITS = {"stage3_min_unit_params": 100, "stage3_param_persistence_threshold": 0}  # each block a unit
ENGINE = None  # the engine, referenced until the interpreter finalizes, as in a script


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, nargs="+", choices=(2, 3), required=True)
    parser.add_argument("--ending", nargs="+", choices=("destroy", "none"), required=True)
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--api", choices=("zerokit", "deepspeed", "both"), default="both",
                        help="both: odd runs through zerokit.deepspeed.initialize")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def threads_now() -> set[str]:
    """The ids of this process's threads now, gloo's or not."""
    return set(os.listdir("/proc/self/task"))


def gloo_threads(settle: float = 0.0, besides: set[str] = frozenset()) -> int:
    """gloo's threads alive in this process now, other than those in `besides` (ids from threads_now()).

    A thread is known as gloo's by the name it gives itself when it starts running, so a baseline of gloo's threads
    counted by name can miss one created but not yet run (CI once saw a group's second worker unnamed just after the
    group's first collective, on a loaded machine); a baseline of thread ids cannot.
    A thread just joined (its group destroyed) can stay listed for a moment while the kernel takes it down, after
    pthread_join has returned: on a loaded machine CI once saw one (1 rank in 200) at exit. It runs no code any
    more, and is gone within microseconds; a thread of a group still alive stays. So a count above 0 is looked at
    again, for up to `settle` seconds."""
    give_up = time.monotonic() + settle
    while True:
        count = 0
        for task in threads_now() - besides:
            try:
                count += Path(f"/proc/self/task/{task}/comm").read_text().strip() in GLOO_THREADS
            except OSError:  # a thread that ended while we looked
                pass
        if count == 0 or time.monotonic() > give_up:
            return count
        time.sleep(0.01)


def train(rank: int, rundir: Path, stage: int, ending: str, api: str) -> None:
    """One rank of one run, in the forked process."""
    global ENGINE
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")  # as torchrun sets
    # registered before zerokit's exit hook, so it runs after it, just before the interpreter finalizes
    atexit.register(lambda: (rundir / f"threads{rank}").write_text(str(gloo_threads(settle=0.5))))
    dist.init_process_group("gloo", init_method=f"file://{rundir}/rendezvous", rank=rank, world_size=2)
    zero = {"stage": stage, **(STAGE3_UNITS if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero}
    model = build_model()
    if api == "deepspeed":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        ENGINE, *_ = zerokit.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        ENGINE = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ENGINE.backward(ENGINE(torch.randint(0, VOCAB, (4, SEQUENCE + 1), generator=generator)))
        ENGINE.step()
    if ending == "destroy":
        dist.destroy_process_group()


def fork_rank(rank: int, rundir: Path, stage: int, ending: str, api: str) -> int:
    """The child's pid in the parent; 0 in the child, once it has trained and ended."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        err = os.open(rundir / f"stderr{rank}", os.O_WRONLY | os.O_CREAT)
        os.dup2(err, 2)
        os.dup2(err, 1)
        train(rank, rundir, stage, ending, api)
    return pid


def reap(pids: list[int]) -> list[dict]:
    """How each rank ended: its exit status or the signal that killed it (ranks past RANK_TIMEOUT are killed)."""
    ended: dict[int, dict] = {}
    give_up = time.monotonic() + RANK_TIMEOUT
    while len(ended) < len(pids):
        for pid in pids:
            if pid in ended:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ended[pid] = ({"signal": signal.Signals(os.WTERMSIG(status)).name} if os.WIFSIGNALED(status)
                              else {"exit_status": os.WEXITSTATUS(status)})
            elif time.monotonic() > give_up:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                ended[pid] = {"hung": True}
        time.sleep(0.02)
    return [ended[pid] for pid in pids]


def run_once(index: int, stage: int, ending: str, api: str, root: Path) -> list[dict] | None:
    """One run's two ranks; None in a forked rank (which must then leave main and exit)."""
    rundir = root / f"stage{stage}-{ending}-run{index}"
    rundir.mkdir()
    pids = []
    for rank in range(2):
        pid = fork_rank(rank, rundir, stage, ending, api)
        if pid == 0:
            return None
        pids.append(pid)
    outcomes = reap(pids)
    for rank, outcome in enumerate(outcomes):
        threads = rundir / f"threads{rank}"
        outcome.update(stage=stage, ending=ending, run=index, rank=rank, api=api, stderr=(rundir / f"stderr{rank}").read_text()[-2000:],
                       gloo_threads_at_exit=int(threads.read_text()) if threads.exists() else None)
    return outcomes


def warm_up() -> None:
    """What each rank would import on its own (torch builds its first optimizer through torch._dynamo: seconds)."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    gc.freeze()  # what is imported by now is left out of every rank's collections (at exit: seconds otherwise)


def main() -> None:
    args = parse()
    warm_up()
    outcomes = []
    started = time.monotonic()
    # not a TemporaryDirectory: its finalizer would run at each forked rank's exit too, and remove the folder
    root = Path(tempfile.mkdtemp(prefix="zerokit-exit-"))
    for stage in args.stage:
        for ending in args.ending:
            for index in range(args.runs):
                api = args.api if args.api != "both" else ("deepspeed" if index % 2 else "zerokit")
                run = run_once(index, stage, ending, api, root)
                if run is None:
                    return  # a forked rank: the interpreter exits when this module ends, as a script's does
                outcomes += run
    shutil.rmtree(root, ignore_errors=True)
    Path(args.out).write_text(json.dumps({"seconds": time.monotonic() - started, "ranks": outcomes}))


if __name__ == "__main__":
    main()
