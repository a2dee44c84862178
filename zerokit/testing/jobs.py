"""Several torchrun jobs in one torchrun launch: on each rank, every job runs in a process forked from one that has
imported its frameworks already.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m zerokit.testing.jobs PLAN.json

Tests build the plan with `launch([Job(...), ...], workdir)` and read each job's outcome with `Outcomes.check`.

[Note: jobs forked inside one torchrun launch]
A framework launch (HF Trainer, accelerate, Lightning, TRL, real DeepSpeed) costs about 9 s of this machine's
time, nearly all of it spent before training: torchrun starting (1.3 s of CPU) and each rank importing torch and
the framework (5-6 s of CPU a rank); the training itself takes under a second. A test module that compares a
framework's own run with several zerokit runs paid that once per run. Here torchrun starts the ranks once. Each
rank, for each group of jobs that share their imports, forks a process that imports them (after
`zerokit.deepspeed.install()` for jobs run through the drop-in, the order `python -m zerokit.deepspeed.install`
gives), and that process forks one child per job. The child runs the job's script as `python script.py args`
would (runpy, sys.argv, sys.path[0]), or as `python -m zerokit.deepspeed.install script.py args` would, and
leaves with its exit status. A job's child is a new process for its frameworks' globals (accelerate's
AcceleratorState, transformers' DeepSpeed config, Lightning's environment), so jobs do not see each other's.
Each job meets its peers on a port of its own, whose TCPStore rank 0's child hosts (as under torchrun with its
agent's store turned off): a store shared by successive jobs would hand a job the previous job's addresses, whose
keys are the same. The processes forked from have run no torch operation, so no thread pool is copied half-made
(See [Note: ranks forked from a server that has imported torch] in zerokit/testing/spawn.py).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JOB_TIMEOUT = 300.0  # seconds one job may run on a rank before its process is killed


@dataclass(frozen=True)
class Job:
    """One run of a script on every rank of the launch."""

    name: str  # also the folder (under the launch's workdir) of its logs and exit statuses
    argv: list[str]  # what follows `python`: a script and its arguments, or "-m", a module and its arguments
    install: bool = False  # through `python -m zerokit.deepspeed.install` (no edit to the script)
    preload: tuple[str, ...] = ()  # modules its ranks import before forking it (the job's own heavy imports)
    env: dict[str, str] = field(default_factory=dict)  # set in the job's processes only
    timeout: float = JOB_TIMEOUT


class Outcomes:
    """Each job's exit status on each rank, read from the files the ranks wrote."""

    def __init__(self, workdir: Path, jobs: list[Job], ranks: int, launch: subprocess.CompletedProcess) -> None:
        self.workdir, self.jobs, self.ranks, self.launch = workdir, {job.name: job for job in jobs}, ranks, launch

    def statuses(self, name: str) -> list[str | None]:
        paths = [self.workdir / name / f"rank{rank}.status" for rank in range(self.ranks)]
        return [path.read_text() if path.exists() else None for path in paths]

    def check(self, name: str) -> None:
        """Raise AssertionError, with each rank's last lines, unless the job ended with 0 on every rank."""
        statuses = self.statuses(name)
        if statuses == ["0"] * self.ranks:
            return
        logs = [self.workdir / name / f"rank{rank}.log" for rank in range(self.ranks)]
        tails = "\n".join(f"--- rank {rank} ({status}):\n{path.read_text()[-4000:] if path.exists() else ''}"
                          for rank, (status, path) in enumerate(zip(statuses, logs)))
        raise AssertionError(f"job {name!r} ended with {statuses} (torchrun: {self.launch.returncode})\n{tails}\n"
                             f"--- torchrun:\n{self.launch.stdout[-2000:]}{self.launch.stderr[-3000:]}")


def launch(jobs: list[Job], workdir: Path, ranks: int = 2, env: dict[str, str] | None = None,
           timeout: float = 900) -> Outcomes:
    """Run `jobs` in order under one `torchrun --standalone --nproc_per_node ranks` (See [Note: jobs forked inside
    one torchrun launch]); a job that fails does not stop the others. Read each outcome with Outcomes.check."""
    workdir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(len(jobs))
    plan = {"workdir": str(workdir), "groups": []}
    for job, port in zip(jobs, ports):
        group = plan["groups"][-1] if plan["groups"] else None
        if group is None or (group["install"], group["preload"]) != (job.install, list(job.preload)):
            group = {"install": job.install, "preload": list(job.preload), "jobs": []}
            plan["groups"].append(group)
        group["jobs"].append({**asdict(job), "port": port})
    path = workdir / "plan.json"
    path.write_text(json.dumps(plan))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "zerokit.testing.jobs", str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    return Outcomes(workdir, jobs, ranks, done)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on this machine now (each held until all are chosen, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for each in sockets:
            each.bind(("", 0))
        return [each.getsockname()[1] for each in sockets]
    finally:
        for each in sockets:
            each.close()


# --- on each rank, under torchrun -------------------------------------------------------------------------

def main(plan_path: str) -> None:
    import torch  # noqa: F401  (imported once here, before any fork: every group and job needs it)

    plan = json.loads(Path(plan_path).read_text())
    for group in plan["groups"]:
        _wait(_fork(lambda: _run_group(group, Path(plan["workdir"]))), timeout=None)


def _run_group(group: dict, workdir: Path) -> int:
    """Import what the group's jobs share, then run each job in a child of its own, in order."""
    if group["install"]:
        import zerokit.deepspeed

        zerokit.deepspeed.install()
    for module in group["preload"]:
        importlib.import_module(module)
    rank = os.environ["RANK"]
    for job in group["jobs"]:
        folder = workdir / job["name"]
        folder.mkdir(parents=True, exist_ok=True)
        status = _wait(_fork(lambda: _run_job(job, folder / f"rank{rank}.log")), timeout=job["timeout"])
        (folder / f"rank{rank}.status").write_text(status)
    return 0


def _run_job(job: dict, log: Path) -> int:
    """The job's script in this process, as its command line would run it; its exit status."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.environ.update(job["env"])
    os.environ.update(MASTER_PORT=str(job["port"]), TORCHELASTIC_USE_AGENT_STORE="False")
    argv = (["-m", "zerokit.deepspeed.install"] if job["install"] else []) + job["argv"]
    try:
        _run_command_line(argv)
        return 0
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)


def _run_command_line(argv: list[str]) -> None:
    """What `python *argv` runs, in this process."""
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def _fork(body: Any) -> int:
    """A child that runs `body()` and leaves with what it returns (1 if it raised), after the atexit handlers a
    process that ended there would have run; it dies with its parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _die_with_parent()
        code = body()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _die_with_parent() -> None:
    """Linux's PR_SET_PDEATHSIG: a child left behind by a killed launch would hold its port and cores."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _wait(pid: int, timeout: float | None) -> str:
    """The child's exit status ("0", "1", "signal 9"), or "timeout" after killing it once `timeout` has passed."""
    give_up = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status)).replace("-", "signal ", 1)
        if give_up is not None and time.monotonic() > give_up:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1])
