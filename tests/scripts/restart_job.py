"""A training job as a user writes one for `torchrun --max-restarts N` (issue 33): on start it resumes from its
checkpoint directory if there is one, it saves every --save-every steps, and its process group is started by
zerokit.initialize (--group-by zerokit), by the DeepSpeed drop-in's init_distributed (--group-by deepspeed), or by the
script itself (--group-by script). Launched by tests/test_restart.py:

    torchrun --nproc_per_node 2 --max-restarts 1 restart_job.py --out DIR --kill-at 7 --late 3

--kill-at K: in the first attempt, rank 1 kills itself with SIGKILL right after step K (a GPU falling off the bus);
the surviving rank fails in its next collective and torchrun restarts both. --stop-at K: rank 1 stops itself with
SIGSTOP there instead (a frozen rank, which no transport notices), in attempt --stop-in-attempt, having written its
pid in DIR/stopped; rank 0 fails at its deadline (--comm-timeout seconds). Every rank that raises CollectiveError
writes its message and the time in DIR/comm_error_rank<r>_attempt<a>.json; DIR/events gets the time of each kill
from the rank killed (`killed <attempt> <time>`) and of the end of each attempt's first step from rank 0
(`first_step <attempt> <time>`). --late S: in a restarted attempt, rank 1
starts S seconds after rank 0 (a slower node).
--kill-in-save P [P ...]: attempt i kills itself inside the save after step --kill-save-at at point P[i] (See [Note:
a save killed on purpose] in zerokit/checkpoint/faults.py); --tag saves every checkpoint under one tag.
--full-disk-at K: the save after step K finds no room: rank 0 fills the file system of --checkpoints to all but
--room bytes first (--starve fill), or rank 1 lowers its file-size limit to --room bytes (--starve fsize); every rank
records the error it raised in DIR/save_error_rank<r>.txt (and the seconds the save took to fail), trains on, and
saves its last step in DIR/room.
--preempt-at K: preemption on (save_dir: the checkpoint directory); in the first attempt rank 1 writes DIR/in_step
(its pid) during step K and waits for the signal the test sends, before its backward. --slow-exit S: rank 0's process
takes S seconds more to end, after zerokit has closed its engine (an atexit handler registered before initialize, as a
large model's teardown takes long): torchrun, which stops the other ranks as soon as one has exited, sends it SIGTERM
then.
Rank 0 writes DIR/result.json: the losses of the steps each attempt trained, the attempt and the step it resumed
from, the final weights (fp32, by name), and the seconds from the kill to the end of the restarted attempt's first
step (DIR/killed_at: when; the test writes it when it sends a signal) and, in DIR/starts, the step each attempt
started from; every rank that exits with a code writes it, and the time, in DIR/exit_rank<r>_attempt<a>.json.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

import zerokit
from zerokit.checkpoint.faults import KILL_DURING_SAVE
from zerokit.comm import CollectiveError
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(1000 * step + rank))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoints", default=None, help="default: OUT/checkpoints")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--stop-at", type=int, default=0)
    parser.add_argument("--stop-in-attempt", type=int, default=0)
    parser.add_argument("--comm-timeout", type=float, default=30.0)
    parser.add_argument("--late", type=float, default=0.0)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--group-by", choices=("zerokit", "deepspeed", "script"), default="zerokit",
                        help="who starts the process group")
    parser.add_argument("--kill-in-save", nargs="*", default=[])
    parser.add_argument("--async-save", action="store_true", help="save in the background (async_save=True)")
    parser.add_argument("--kill-save-at", type=int, default=8)
    parser.add_argument("--full-disk-at", type=int, default=0)
    parser.add_argument("--starve", choices=("fill", "fsize"), default="fill")
    parser.add_argument("--room", type=int, default=64 << 10)
    parser.add_argument("--preempt-at", type=int, default=-1)
    parser.add_argument("--slow-exit", type=float, default=0.0)
    return parser.parse_args()


def start_group(args: argparse.Namespace) -> None:
    if args.group_by == "script":  # bounded: after a restart it can wait on keys nobody will write again
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=20))
    elif args.group_by == "deepspeed":
        import zerokit.deepspeed as deepspeed

        deepspeed.init_distributed()


def build(args: argparse.Namespace, checkpoints: Path) -> zerokit.Engine:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    config = {"zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0,
              "comm_timeout_seconds": args.comm_timeout}
    if args.preempt_at >= 0:
        config["preemption"] = {"enabled": True, "save_dir": str(checkpoints)}
    return zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2), config)


def fill_disk(directory: Path, room: int) -> None:
    """Fill the file system `directory` is on, then give back `room` bytes: a disk that is actually full."""
    with open(directory.parent / "filler", "wb", buffering=0) as file:
        for block in (1 << 20, 4096):
            try:
                while file.write(b"\0" * block):
                    pass
            except OSError:
                pass
        file.truncate(max(file.tell() - room, 0))


def save(engine: zerokit.Engine, args: argparse.Namespace, checkpoints: Path, step: int, attempt: int,
         rank: int) -> None:
    if step == args.kill_save_at and attempt < len(args.kill_in_save):
        os.environ[KILL_DURING_SAVE] = args.kill_in_save[attempt]
        (Path(args.out) / "killed_at").write_text(repr(time.time()))  # a few milliseconds early
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if step == args.full_disk_at and args.starve == "fill" and rank == 0:
        fill_disk(checkpoints, args.room)
    if step == args.full_disk_at and args.starve == "fsize" and rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.room, limit[1]))
    began = time.monotonic()
    try:
        engine.save_checkpoint(checkpoints, tag=args.tag, async_save=args.async_save)
    except RuntimeError as error:
        (Path(args.out) / f"save_error_rank{rank}.txt").write_text(str(error))
        (Path(args.out) / f"save_error_seconds_rank{rank}.txt").write_text(f"{time.monotonic() - began:.3f}")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)


def wait_for_the_signal(engine: zerokit.Engine, out: Path) -> None:
    (out / "in_step").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not engine.preemption.requested and time.monotonic() < deadline:
        time.sleep(0.01)


def note(out: Path, event: str) -> None:
    with open(out / "events", "a") as events:
        events.write(event + "\n")


def train(engine: zerokit.Engine, args: argparse.Namespace, checkpoints: Path, attempt: int, rank: int,
          start: int) -> tuple[list[float], float | None]:
    out, losses, first_step_done = Path(args.out), [], None
    for step in range(start, args.steps):
        tokens = batch(step, rank)
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        if attempt == 0 and rank == 1 and step == args.preempt_at:
            wait_for_the_signal(engine, out)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == start:
            first_step_done = time.time()
            if rank == 0:
                note(out, f"first_step {attempt} {first_step_done!r}")
        if rank == 1 and (attempt, step + 1) in ((0, args.kill_at), (args.stop_in_attempt, args.stop_at)):
            (out / "killed_at").write_text(repr(time.time()))
            note(out, f"killed {attempt} {time.time()!r}")
            (out / "stopped").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL if (attempt, step + 1) == (0, args.kill_at) else signal.SIGSTOP)
        if (step + 1) % args.save_every == 0:
            save(engine, args, checkpoints, step + 1, attempt, rank)
    return losses, first_step_done


def main(args: argparse.Namespace, attempt: int, rank: int) -> None:
    if attempt > 0 and rank == 1:
        time.sleep(args.late)
    start_group(args)
    if args.slow_exit and rank == 0:  # runs after zerokit's own exit handler, which initialize registers
        atexit.register(time.sleep, args.slow_exit)
    checkpoints = Path(args.checkpoints or Path(args.out) / "checkpoints")
    engine = build(args, checkpoints)
    start = 0
    if (checkpoints / "latest").exists():
        engine.load_checkpoint(checkpoints)
        start = engine.progress.optimizer_step
    if rank == 0:
        with open(Path(args.out) / "starts", "a") as starts:
            starts.write(f"{attempt} {start}\n")
    losses, first_step_done = train(engine, args, checkpoints, attempt, rank, start)
    if args.full_disk_at:
        engine.save_checkpoint(Path(args.out) / "room")  # a place with room: the next save succeeds
    weights = {name: value.tolist() for name, value in engine.full_state_dict().items()}
    if rank == 0:
        killed = Path(args.out) / "killed_at"
        recovery = first_step_done - float(killed.read_text()) if killed.exists() and first_step_done else None
        (Path(args.out) / "result.json").write_text(json.dumps(
            {"attempt": attempt, "resumed_from": start, "losses": losses, "weights": weights,
             "seconds_from_kill_to_first_resumed_step": recovery}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    options = arguments()
    attempt_number, rank_number = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ["RANK"])
    try:
        main(options, attempt_number, rank_number)
    except CollectiveError as failed:  # a peer went silent: what this rank said, and when
        (Path(options.out) / f"comm_error_rank{rank_number}_attempt{attempt_number}.json").write_text(json.dumps(
            {"message": str(failed), "time": time.time()}))
        raise
    except SystemExit as leaving:  # a preempted engine's exit code, and when it left
        exit_record = Path(options.out) / f"exit_rank{rank_number}_attempt{attempt_number}.json"
        exit_record.write_text(json.dumps({"code": leaving.code, "time": time.time()}))
        sys.exit(leaving.code)
