"""A job that loses a rank comes back under `torchrun --max-restarts` (issue 33): tests/scripts/restart_job.py, a
stage-2 job on 2 gloo ranks that saves every 4 steps and resumes from its checkpoint directory on start. Rank 1
kills itself with SIGKILL after step 7; torchrun restarts both ranks, rank 1 three seconds after rank 0 (a slower
node), which is when torch's own start read the previous attempt's keys in the agent's shared store and failed
(See [Note: a key space per attempt] in zerokit/comm/rendezvous.py). The restarted job resumes at step 4 and
ends with the uninterrupted job's weights, bit for bit (the same world size, data and stage), whether
zerokit.initialize or the drop-in's deepspeed.init_distributed started the group. A script that starts the group
itself is told, after a restart, which setting avoids the fault. The same job, killed by every rank inside a save,
finding its disk full at a save, and preempted with SIGTERM and SIGUSR1, ends as the uninterrupted one too (items 4
and 5). Each launch costs about 10 s here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch.distributed as dist

from zerokit.checkpoint import read_manifest
from zerokit.checkpoint.files import CheckedReader
from zerokit.comm import rendezvous

SCRIPT = Path(__file__).parent / "scripts" / "restart_job.py"


def command(out: Path, *args: str, restarts: int = 1, script: Path = SCRIPT) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", str(restarts), str(script), "--out", str(out), *args]


def run(out: Path, *args: str, restarts: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(command(out, *args, restarts=restarts), capture_output=True, text=True, timeout=300)


def launch(out: Path, *args: str, restarts: int = 1) -> tuple[subprocess.CompletedProcess, dict]:
    done = run(out, *args, restarts=restarts)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    return done, json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return launch(tmp_path_factory.mktemp("uninterrupted"))[1]


@pytest.mark.parametrize("start", ["zerokit", "deepspeed"])
def test_a_killed_rank_comes_back_late_and_the_job_ends_as_if_never_killed(uninterrupted, tmp_path, start) -> None:
    _, restarted = launch(tmp_path, "--kill-at", "7", "--late", "3", "--group-by", start)
    assert uninterrupted["attempt"] == 0 and uninterrupted["resumed_from"] == 0
    assert restarted["attempt"] == 1 and restarted["resumed_from"] == 4  # the last save before the kill
    assert restarted["losses"] == uninterrupted["losses"][4:]
    assert restarted["weights"] == uninterrupted["weights"]


def test_a_script_that_starts_the_group_itself_is_told_the_setting(tmp_path) -> None:
    """Its group got through the restart's start (both ranks came back together), but every group made after it
    reads torch's fixed keys too, zerokit's own among them: the warning comes before the engine makes any, and
    names the setting (measured here: the restarted job then failed in connectFullMesh at its first new group)."""
    done = run(tmp_path, "--kill-at", "7", "--group-by", "script")
    assert "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in done.stderr, done.stderr[-5000:]


def test_a_rank_that_reads_a_dead_attempt_waits_for_the_living_one() -> None:
    """The protocol alone, on a store holding what a dead attempt left: its id and its welcome. Rank 1 reads the
    stale id first, says hello, is never welcomed there, and joins the id rank 0 publishes a moment later."""
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    peer_store = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timeout)  # its own client
    store.set(rendezvous.ATTEMPT_KEY, "dead")
    store.set("zerokit/dead/welcome", "someone-else")
    joined: list[str] = []
    peer = threading.Thread(target=lambda: joined.append(rendezvous._join_attempt(peer_store, 1, timeout)))
    peer.start()
    time.sleep(0.5)
    assert not joined and store.check(["zerokit/dead/hello/1"])  # it answered the dead id, and waits
    living = rendezvous._publish_attempt(store, 2, timeout)
    peer.join(timeout=30)
    assert joined == [living] and living != "dead"


# --- a save that dies (item 5) ----------------------------------------------------------------------------------

def test_every_rank_killed_inside_a_save_resumes_from_the_checkpoint_before(uninterrupted, tmp_path) -> None:
    """Every checkpoint under one tag, so that a commit replaces the one before. Attempt 0: both ranks SIGKILL
    themselves half-way through their rank files in the save after step 8; attempt 1 resumes at step 4 and rank 0 is
    killed between moving that checkpoint aside and moving the new one in (the one moment the tag's directory does
    not exist); attempt 2 resumes at step 4 from where the commit moved it, and ends with the uninterrupted weights.
    Before, attempt 2 failed: the tag's manifest missing (See [Note: a save killed on purpose])."""
    done, restarted = launch(tmp_path, "--tag", "last", "--kill-in-save", "rank-file", "commit", restarts=2)
    assert (tmp_path / "starts").read_text() == "0 0\n1 4\n2 4\n"
    assert "killed while it replaced the checkpoint there" in done.stderr
    assert restarted["losses"] == uninterrupted["losses"][4:]
    assert restarted["weights"] == uninterrupted["weights"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last", "latest"]  # no leftovers


def test_every_rank_killed_inside_an_asynchronous_save_resumes_from_the_checkpoint_before(uninterrupted,
                                                                                        tmp_path) -> None:
    """The save after step 8 writes in the background while training goes on; both ranks SIGKILL themselves half-way
    through their rank files there. The checkpoint of step 4 stays the latest, and the job resumes from it."""
    _, restarted = launch(tmp_path, "--async-save", "--kill-in-save", "rank-file")
    assert (tmp_path / "starts").read_text() == "0 0\n1 4\n"
    assert restarted["losses"] == uninterrupted["losses"][4:]
    assert restarted["weights"] == uninterrupted["weights"]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs, which the job fills before its second save (a disk that is actually full), where this process
    may mount one (root); else a plain directory, and rank 1 lowers its file-size limit instead (EFBIG)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    yield disk, "fill" if mounted else "fsize"
    if mounted:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_save_that_finds_the_disk_full_fails_on_every_rank_and_training_goes_on(uninterrupted, tmp_path,
                                                                                 small_disk) -> None:
    disk, starve = small_disk
    checkpoints = disk / "checkpoints"
    _, result = launch(tmp_path, "--checkpoints", str(checkpoints), "--full-disk-at", "8", "--starve", starve)
    errors = [(tmp_path / f"save_error_rank{rank}.txt").read_text() for rank in (0, 1)]
    assert errors[0] == errors[1] and "\n" not in errors[0], errors
    assert errors[0].startswith(f"checkpoint 'global_step8' was not saved in {checkpoints}: rank "), errors[0]
    cause = "the disk is full (ENOSPC" if starve == "fill" else "file-size limit (EFBIG"
    assert cause in errors[0] and errors[0].endswith("`latest` still names 'global_step4'"), errors[0]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step4", "latest"]  # staging removed
    assert (checkpoints / "latest").read_text() == "global_step4"
    manifest = read_manifest(checkpoints / "global_step4")
    for record in manifest.files.values():  # intact: every chunk of every file against its checksum
        reader = CheckedReader(checkpoints / "global_step4" / record.name, record)
        reader.read(0, record.bytes)
        reader.close()
    assert manifest.progress["optimizer_step"] == 4
    assert result["attempt"] == 0 and result["weights"] == uninterrupted["weights"]  # it trained on, unharmed
    assert (tmp_path / "room" / "latest").read_text() == "global_step10"  # and saved where there was room


# --- preemption (item 4) ----------------------------------------------------------------------------------------

def preempted(out: Path, at: int, target: Callable[[subprocess.Popen], int], number: signal.Signals, *args: str,
              restarts: int = 1, script: Path = SCRIPT) -> subprocess.Popen:
    """Launch the job with preemption on; when rank 1 is inside step `at` (0-based, before its backward), send
    `number` to the process `target` names, and note when (DIR/killed_at). Returns the finished launch. `script`:
    another job with the same protocol (DIR/in_step; FRAMEWORKS signals at its own step)."""
    (out / "in_step").unlink(missing_ok=True)
    launch_args = ("--preempt-at", str(at), *args) if script == SCRIPT else args
    job = subprocess.Popen(command(out, *launch_args, restarts=restarts, script=script), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "in_step").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.05)  # the pid is written
    (out / "killed_at").write_text(repr(time.time()))
    os.kill(target(job), number)
    job.stdout_text, job.stderr_text = job.communicate(timeout=300)
    return job


def assert_saved_the_step_in_flight(out: Path, in_flight: int) -> None:
    exits = [json.loads((out / f"exit_rank{rank}_attempt0.json").read_text()) for rank in (0, 1)]
    assert [e["code"] for e in exits] == [75, 75]  # every rank, the one not signalled too
    saved = read_manifest(out / "checkpoints" / f"global_step{in_flight + 1}")
    assert saved.progress["optimizer_step"] == in_flight + 1  # steps 0 to in_flight, no more, no less


def test_a_preempted_job_saves_the_step_in_flight_exits_to_be_requeued_and_resumes_exactly(uninterrupted,
                                                                                           tmp_path) -> None:
    """A scheduler's SIGTERM to the launcher, which passes it on to every worker, while rank 1 is inside step 5:
    both ranks finish it, save it and exit with 75; torchrun ends. The job launched again (requeued) resumes at
    step 6, and SIGUSR1 (SLURM's --signal) reaches rank 1 alone inside step 6: both ranks save it and exit with 75,
    torchrun restarts them, and the job resumes at step 7 and ends with the uninterrupted weights."""
    job = preempted(tmp_path, 5, lambda launched: launched.pid, signal.SIGTERM)
    assert job.returncode != 0 and not (tmp_path / "result.json").exists(), job.stderr_text[-5000:]
    assert_saved_the_step_in_flight(tmp_path, 5)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step6"
    job = preempted(tmp_path, 6, lambda _: int((tmp_path / "in_step").read_text()), signal.SIGUSR1)
    assert job.returncode == 0, job.stderr_text[-5000:]
    assert_saved_the_step_in_flight(tmp_path, 6)
    assert (tmp_path / "starts").read_text() == "0 0\n0 6\n1 7\n"  # launch, attempt: the step it started from
    resumed = json.loads((tmp_path / "result.json").read_text())
    assert resumed["losses"] == uninterrupted["losses"][7:] and resumed["weights"] == uninterrupted["weights"]


def torchrun_exit_codes(stderr: str) -> dict[int, int]:
    """Each failed rank's exit code as torchrun reports it (its ChildFailedError summary)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


def signal_rank_1(out: Path) -> Callable[[subprocess.Popen], int]:
    return lambda _: int((out / "in_step").read_text())


def test_every_rank_leaves_with_the_requeue_code_torchrun_reports(tmp_path) -> None:
    """torchrun stops the other ranks with SIGTERM as soon as one has exited. Rank 0, saved and on its way out (its
    exit here takes 3 s longer, as a large model's teardown does), was reported by torchrun as -15, not 75 (2 of 3
    launches in issue 44, 3 of 16 here): a preempted rank now ignores the block's signals until it has exited."""
    job = preempted(tmp_path, 5, signal_rank_1(tmp_path), signal.SIGUSR1, "--slow-exit", "3", restarts=0)
    assert torchrun_exit_codes(job.stderr_text) == {0: 75, 1: 75}, job.stderr_text[-3000:]
    assert_saved_the_step_in_flight(tmp_path, 5)


FRAMEWORKS = Path(__file__).parent / "scripts" / "preempt_frameworks.py"


def assert_framework_saved_step_3(out: Path) -> None:
    exits = [json.loads((out / f"exit_rank{rank}.json").read_text())["code"] for rank in (0, 1)]
    assert exits == [75, 75]
    assert read_manifest(out / "checkpoints" / "global_step4").progress["optimizer_step"] == 4
    assert (out / "checkpoints" / "latest").read_text() == "global_step4"


def test_the_deepspeed_drop_in_is_preempted_as_zerokit_is(tmp_path) -> None:
    """deepspeed.initialize with the config's preemption block, engine.backward and engine.step, SIGUSR1 to rank 1
    inside step 3: both ranks save step 3 and leave with 75, as torchrun reports."""
    job = preempted(tmp_path, 3, signal_rank_1(tmp_path), signal.SIGUSR1, "--via", "deepspeed", restarts=0,
                    script=FRAMEWORKS)
    assert torchrun_exit_codes(job.stderr_text) == {0: 75, 1: 75}, job.stderr_text[-3000:]
    assert_framework_saved_step_3(tmp_path)


def test_lightning_is_preempted_by_the_schedulers_sigterm(tmp_path) -> None:
    """Lightning's ZerokitStrategy with the preemption block, SIGTERM to torchrun (a scheduler's), which passes it on:
    Lightning's own SIGTERM handler, installed over zerokit's after the strategy's setup, broadcast from inside the
    handler and crashed the job; the strategy takes the signal back at on_train_start, and both ranks save step 3 and
    leave with 75 (torchrun, itself signalled, reports no codes: each rank's own record)."""
    job = preempted(tmp_path, 3, lambda launched: launched.pid, signal.SIGTERM, "--via", "lightning", restarts=0,
                    script=FRAMEWORKS)
    assert job.returncode != 0 and "Received SIGTERM" not in job.stderr_text, job.stderr_text[-3000:]
    assert_framework_saved_step_3(tmp_path)
