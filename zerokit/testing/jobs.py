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
Each job meets its peers in a TCPStore of its own: a store shared by successive jobs would hand a job the previous
job's addresses, whose keys are the same. Rank 0's child hosts it on a port the kernel gives it (a port chosen
beforehand and bound later was once taken in between by another test's process) and posts the port in torchrun's
agent store, where the other ranks' children read it; then every rank's script reaches the job's store as
torchrun's own store is reached (TORCHELASTIC_USE_AGENT_STORE). The ranks start each job together: a rank that
finishes a job waits for the others' statuses, and a rank whose peer failed stops its own child after a short
grace, so that one failure costs one job, not a timeout in every job after it. The processes forked from have run
no torch operation, so no thread pool is copied half-made (See [Note: ranks forked from a server that has imported
torch] in zerokit/testing/spawn.py).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

JOB_TIMEOUT = 300.0  # seconds one job may run on a rank before its process is killed
PEER_FAILED_GRACE = 10.0  # seconds a rank's job may go on after a peer's ended with an error
_HOSTED: list = []  # rank 0's store of the job running in this process, kept alive for the job's life


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

    def __init__(self, workdir: Path, ranks: int, launch: subprocess.CompletedProcess) -> None:
        self.workdir, self.ranks, self.launch = workdir, ranks, launch

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
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names must differ (each names its folder and its keys), got {names}")
    workdir.mkdir(parents=True, exist_ok=True)
    plan = {"workdir": str(workdir), "groups": []}
    for job in jobs:
        group = plan["groups"][-1] if plan["groups"] else None
        if group is None or (group["install"], group["preload"]) != (job.install, list(job.preload)):
            group = {"install": job.install, "preload": list(job.preload), "jobs": []}
            plan["groups"].append(group)
        group["jobs"].append(asdict(job))
    path = workdir / "plan.json"
    path.write_text(json.dumps(plan))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "zerokit.testing.jobs", str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    return Outcomes(workdir, ranks, done)


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
    rank, agent = int(os.environ["RANK"]), _agent_store()
    for job in group["jobs"]:
        folder = workdir / job["name"]
        folder.mkdir(parents=True, exist_ok=True)
        peers = _Peers(agent, job["name"], rank, int(os.environ["WORLD_SIZE"]))
        status = _wait(_fork(lambda: _run_job(job, folder / f"rank{rank}.log")), job["timeout"], peers)
        (folder / f"rank{rank}.status").write_text(status)
        peers.post(status)
        peers.wait_for_all(timeout=job["timeout"])
    return 0


def _agent_store() -> Any:
    """torchrun's agent store (a client of it), through which the ranks of a job find each other."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise RuntimeError("zerokit.testing.jobs runs under torchrun with its agent's store (torchrun --standalone "
                           "sets TORCHELASTIC_USE_AGENT_STORE=True)")
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timedelta(seconds=JOB_TIMEOUT))


class _Peers:
    """One job's statuses as the ranks post them in the agent store."""

    def __init__(self, agent: Any, job: str, rank: int, world_size: int) -> None:
        self.agent, self.rank = agent, rank
        self.keys = {peer: f"zerokit/jobs/{job}/status/{peer}" for peer in range(world_size)}

    def post(self, status: str) -> None:
        self.agent.set(self.keys[self.rank], status)

    def failed(self) -> bool:
        """Whether another rank's job ended with anything but 0."""
        return any(self.agent.check([key]) and self.agent.get(key) != b"0"
                   for peer, key in self.keys.items() if peer != self.rank)

    def wait_for_all(self, timeout: float) -> None:
        self.agent.wait(list(self.keys.values()), timedelta(seconds=timeout + PEER_FAILED_GRACE))


def _meet(job: dict) -> None:
    """Point this process's torch.distributed at the job's own store: hosted here on rank 0, on a port the kernel
    gives (See [Note: jobs forked inside one torchrun launch]), found by the others in the agent store."""
    import torch.distributed as dist

    agent, key = _agent_store(), f"zerokit/jobs/{job['name']}/port"
    if os.environ["RANK"] == "0":
        _HOSTED.append(dist.TCPStore("0.0.0.0", 0, None, True, timedelta(seconds=job["timeout"]),
                                     wait_for_workers=False))
        agent.set(key, str(_HOSTED[-1].port))
    os.environ["MASTER_PORT"] = agent.get(key).decode()  # waits for rank 0's post


def _run_job(job: dict, log: Path) -> int:
    """The job's script in this process, as its command line would run it; its exit status."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.environ.update(job["env"])
    _meet(job)
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


def _wait(pid: int, timeout: float | None, peers: _Peers | None = None) -> str:
    """The child's exit status ("0", "1", "signal 9"); "timeout" after killing it once `timeout` has passed, or "a
    peer failed" after killing it PEER_FAILED_GRACE seconds after another rank's job ended with an error."""
    give_up = None if timeout is None else time.monotonic() + timeout
    peer_failed_at, looked = None, 0.0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status)).replace("-", "signal ", 1)
        now = time.monotonic()
        if peer_failed_at is None and peers is not None and now - looked > 0.5:
            looked = now
            peer_failed_at = now if peers.failed() else None
        for deadline, why in ((give_up, "timeout"), (peer_failed_at and peer_failed_at + PEER_FAILED_GRACE,
                                                     "a peer failed")):
            if deadline is not None and now > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return why
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1])
