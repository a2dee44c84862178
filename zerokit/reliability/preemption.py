"""A job told to go (SIGTERM, SIGUSR1) finishes the step in flight, saves, and exits with a code that asks to be
requeued: the config's `preemption` block (zerokit/config/dsconfig/blocks.py), off unless enabled.

[Note: preemption]
What sends what before it kills: torchrun's agent, itself sent SIGTERM (by SLURM at a job's end or scancel, by
Kubernetes at a pod's deletion), passes SIGTERM on to every worker and kills them with SIGKILL after
--shutdown-timeout (30 s); Kubernetes kills after terminationGracePeriodSeconds (30 s); SLURM sends
`--signal=USR1@<seconds>` that long before the end of an allocation (Lightning's SLURM auto-requeue listens for it)
and SIGKILL KillWait (30 s) after SIGTERM. So:
  - The handler only records the signal: a save from inside a handler (as Lightning's SLURM handler does) would run
    in the middle of a backward or an optimizer step, between collectives the other ranks are inside.
  - engine.step() looks at the end of each accumulation window, after the optimizer step, where a checkpoint holds
    no gradients in flight: one all-reduce of the signal number (MAX) over the ranks, a few bytes, so that a
    signal any rank got is every rank's (a signal can reach some ranks only: one node drained, one process sent
    it; a rank that went on alone would hang the others, and one a step ahead would save another model).
  - Then every rank saves the checkpoint of that step (synchronously: an asynchronous save in flight is waited
    for first), rank 0 logs what was saved and how long it took, and engine.step() raises `Preempted`, a
    SystemExit with `exit_code`, which the interpreter exits with once the engine is closed (zerokit closes it at
    exit). A preemption save that fails (a full disk) raises its error instead, and the job resumes from the
    checkpoint before. Default 75, sysexits.h's EX_TEMPFAIL ("try again later"): torchrun restarts on any code but
    0 (within --max-restarts); SLURM requeues on it with `RequeueExit=75` in slurm.conf; Kubernetes with a
    podFailurePolicy rule `onExitCodes: {operator: In, values: [75]}` and action Ignore (a retry not counted
    against backoffLimit). 0 would read as a finished job, 1 as a crash, 128+N as a process killed by signal N.
Bound: from the signal to the saved checkpoint, the rest of the accumulation window in flight (at most
gradient_accumulation_steps micro-steps and one optimizer step), one all-reduce and one save; docs/reliability.md
gives the figure measured. A rank blocked in a collective sees its flag when the collective returns, so a rank
stalled for good is not saved by this (the collectives' deadline names it instead).
Handlers are installed at initialize (the main thread: Python runs handlers there only) and the previous ones put
back at engine.close(); one open engine of a process may have them (a second is refused: a signal would reach one of
the two only).
Once saved, a rank is leaving: the block's signals are ignored from then on, and again at the interpreter's exit (an
atexit hook, which runs before zerokit's own, so that closing the engine there leaves them ignored): torchrun stops
the other ranks with SIGTERM as soon as one has exited, and a rank that had saved too and was on its way out (the
interpreter's end takes 0.6-0.9 s with torch's optimizer modules loaded) died of it; torchrun reported -15 for it
instead of the exit code (issue 44; docs/reliability.md, "What torchrun reports"). A program that catches Preempted
and goes on gets the handlers found at initialize back when it closes the engine, as without a preemption. If a
rank's exit hangs, torchrun's SIGKILL after --shutdown-timeout still ends it.
Where the code goes: to whoever started the ranks. torchrun reads it as a failure and restarts the ranks within
--max-restarts (a signal to some ranks only); torchrun itself sent SIGTERM exits with 1 whatever its workers did
(torch 2.13), so a scheduler around torchrun requeues on its own signal (docs/reliability.md gives a batch script);
SIGUSR1 sent to torchrun kills it and its ranks at once.
"""

from __future__ import annotations

import atexit
import signal
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerokit._support.log import logger
from zerokit.comm import Communicator
from zerokit.config.dsconfig.blocks import Preemption
from zerokit.precision.result import StepResult


class Preempted(SystemExit):
    """Raised by engine.step() once the preemption checkpoint is saved; its code is preemption.exit_code."""


class PreemptionWatcher:
    """One engine's signal handlers and the check at the end of each accumulation window (See [Note: preemption]).
    `save(save_dir)` saves the engine's checkpoint (the engine's own save_checkpoint, a subclass's included)."""

    def __init__(self, policy: Preemption, comm: Communicator, save: Callable[[str], Any]) -> None:
        self.policy, self.comm, self.save = policy, comm, save
        self.received = 0  # the number of the last signal this rank got; 0: none
        self.leaving = False  # saved and raising Preempted: the block's signals are ignored from now on
        self.exiting = False  # a preempted process at its exit: they stay ignored (See [Note: preemption])
        self.numbers = [signal.Signals[name] for name in policy.signals]
        self.previous: dict[signal.Signals, Any] = {}
        if policy.enabled:
            self._install()

    @property
    def requested(self) -> bool:
        """This rank got one of the signals; the engine saves and exits at the end of the window in flight."""
        return self.received != 0

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("preemption.enabled needs zerokit.initialize in the main thread: Python runs signal "
                             "handlers there only")
        for name in self.policy.signals:
            number = signal.Signals[name]
            if isinstance(getattr(signal.getsignal(number), "__self__", None), PreemptionWatcher):
                raise ValueError(f"preemption is enabled in another open engine of this process, which catches "
                                 f"{name} already; enable it in one engine (the one whose step() ends the loop)")
            self.previous[number] = signal.signal(number, self._record)

    def _record(self, number: int, frame: Any) -> None:
        self.received = number  # only this: See [Note: preemption]

    def take_signals_back(self) -> None:
        """The block's signals to this engine's handler again, alone, where a framework installed its own over it
        after initialize (Lightning's SIGTERM handler broadcasts from inside the handler, while the other ranks are
        in other collectives: it crashed the job). close() still puts back the handlers found at initialize."""
        if self.policy.enabled and not self.leaving and threading.current_thread() is threading.main_thread():
            for number in self.previous:
                signal.signal(number, self._record)

    def after_step(self, result: StepResult) -> None:
        """Every rank, after each engine.step(): at the end of an accumulation window, save and exit if any rank got
        a signal."""
        if not self.policy.enabled or not result.boundary:
            return
        flag = torch.tensor([float(self.received)], device=self.comm.device)
        self.comm.all_reduce(flag, op=dist.ReduceOp.MAX, purpose="preemption: did any rank get a signal")
        number = int(flag.item())
        if number:
            self._save_and_exit(signal.Signals(number), result.optimizer_step)

    def _save_and_exit(self, received: signal.Signals, optimizer_step: int) -> None:
        began = time.monotonic()
        self.save(self.policy.save_dir)
        if self.comm.rank == 0:
            logger.warning(f"preempted ({received.name}): saved optimizer step {optimizer_step} in "
                           f"{self.policy.save_dir} in {time.monotonic() - began:.2f} s; exiting with code "
                           f"{self.policy.exit_code} (requeue)")
        self._ignore_while_leaving()
        raise Preempted(self.policy.exit_code)

    def _ignore_while_leaving(self) -> None:
        """See [Note: preemption]: a launcher's SIGTERM to a rank already leaving would replace its exit code."""
        self.leaving = True
        self._ignore()
        atexit.register(self._ignore_at_exit)

    def _ignore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for number in self.numbers:
                signal.signal(number, signal.SIG_IGN)

    def _ignore_at_exit(self) -> None:
        self.exiting = True
        self._ignore()

    def close(self) -> None:
        """Put back the handlers found at install (from the main thread; elsewhere they stay, harmless); at the exit
        of a preempted process, leave the signals ignored (See [Note: preemption])."""
        if threading.current_thread() is not threading.main_thread() or self.exiting:
            return
        ours = (self._record, signal.SIG_IGN) if self.leaving else (self._record,)
        for number, handler in self.previous.items():
            if signal.getsignal(number) in ours:
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}


__all__ = ["Preempted", "PreemptionWatcher"]
