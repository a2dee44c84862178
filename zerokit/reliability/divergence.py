"""Stage 3: every rank gathers the same unit at the same point, or every rank hears which unit each asked for.

[Note: stage-3 units every rank agrees on]
A unit is gathered by collectives that every rank must issue in the same order. A unit that runs on some
ranks only (data-dependent control flow: a layer some batches skip, an expert no token of this rank reached)
breaks that: the other ranks' next gather pairs with it, and the job hangs, or, when the sizes happen to
match, computes with another unit's weights without a word (one silently wrong eval output, then an abort,
was what a user saw). So every unit gather carries its unit: beside the gather, on the control group (CPU,
gloo; See Communicator.control), each rank all-reduces (SUM) a table with one row per rank that only its own
row fills: the unit it asks for, the phase (between steps, forward, backward), its micro-step and whether it
is a prefetch. After that one collective every rank knows what every rank asked for. The end of each forward
and of each backward is one more such row ("nothing more"), so a rank that skipped the last unit is caught
there, not at a timeout. What happens when rows differ is `Stage3Policy.skipped_units`:

  "raise" (the default): a difference raises SkippedUnitError on every rank at that gather, naming the module
  each rank asked for, the phase and the micro-step, before any rank computes with the wrong weights. When
  every unit but the root gathers buckets of the same sizes (a stack of equal blocks: the usual case), the
  row is issued asynchronously right before the unit's own gathers and checked right before their data is
  used: two ranks that part gather equal sizes, which pair harmlessly, so the row costs one small all-reduce
  per unit gather, overlapped with it. When units differ in size, each rank waits for the rows before it
  starts the gather: gathers of different sizes must never pair (gloo aborts the process, SIGABRT, with no
  word; NCCL hangs or corrupts), so the row is then a round trip of latency before every unit gather. (The
  root is always a phase's first gather on every rank.) Either way, one waited-on row at the end of each
  forward and each backward.

  "gather": the ranks agree before any data moves: each unit gather first waits for the table, and every rank
  gathers the unit that comes first (in forward order in forward, in reverse order in backward, "nothing more"
  last); a rank that did not ask for it gathers it too and frees it at once (a rank that already holds it
  gathers it again in place), then asks again. Every rank thus issues the same gathers, a skipped unit is
  gathered by the ranks that skip it at the point where the others use it, and training (or a no_grad eval)
  computes exactly what each rank's control flow asks for. Sound for any order in which ranks ask, since every
  round serves at least the rank that asked for the unit that comes first. Its cost: each unit gather waits
  for one small all-reduce before it starts (a round trip of latency, and prefetches no longer overlap it),
  a skipped unit's gather on the ranks that skip it (bandwidth, and its size in memory for that moment), and
  gradient reductions are not capped at MAX_BUCKETS_IN_FLIGHT during backward (a cap's wait on one rank could
  otherwise wait for a reduction that another rank can only start after this rank joins its next agreement),
  so a skipped unit's backward may hold up to every gradient bucket's staging copy until the end of backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from zerokit.comm import Communicator, Pending, wait

if TYPE_CHECKING:
    from zerokit.stages.units import Unit

PHASES = ("between steps", "forward", "backward")
RAISE, GATHER = "raise", "gather"
ROW = 3  # per rank: unit index + 1 (len(units) + 1: nothing more), phase, micro-step * 2 + prefetch


class SkippedUnitError(RuntimeError):
    """At stage 3 the ranks asked for different units at the same gather."""


class UnitAgreement:
    """See [Note: stage-3 units every rank agrees on]."""

    def __init__(self, control: Communicator, units: list["Unit"], mode: str, wait_before_gather: bool) -> None:
        """`wait_before_gather`: "raise" checks each row before the unit's gathers start, not before their data
        is used (units whose gathers differ in size; See the Note)."""
        self.control, self.units, self.mode = control, units, mode
        self.wait_before_gather = wait_before_gather
        self.nothing = len(units)  # the "unit" a rank asks for when it has nothing more to gather
        self.phase = PHASES[0]
        self.micro_step = 0  # backwards finished so far (the engine's micro-step)
        self.rounds = 0  # tables this rank has issued
        self.pending: dict[int, tuple[int, Pending]] = {}  # unit index -> (round, its table), mode "raise"
        self.served = 0  # gathers this rank issued only because another rank asked ("gather")

    # --- "raise" ---------------------------------------------------------------------------------------------
    def announce(self, unit: int, prefetch: bool) -> None:
        """Right before the unit's gathers: issue its row, checked now or by `confirm`."""
        round_, pending = self.rounds, self._issue(unit, prefetch)
        if self.wait_before_gather:
            self._check(round_, pending)
        else:
            self.pending[unit] = (round_, pending)

    def confirm(self, unit: int) -> None:
        """Right before the unit's gathered data is waited on or freed: every rank asked for it, or raise."""
        entry = self.pending.pop(unit, None)
        if entry is not None:
            self._check(*entry)

    # --- "gather" --------------------------------------------------------------------------------------------
    def agree(self, unit: int, prefetch: bool, serve: Callable[[int], None]) -> bool:
        """Rounds until this rank's unit is the one every rank gathers (True), `serve`-ing every unit that comes
        first; a prefetch that another rank's request displaced is dropped instead (False)."""
        while True:
            first = self._first(self._rows(self._issue(unit, prefetch)))
            if first == unit:
                return True
            serve(first)
            self.served += 1
            if prefetch:
                return False

    # --- both ------------------------------------------------------------------------------------------------
    def end_phase(self, serve: Callable[[int], None]) -> None:
        """The end of a forward or a backward: this rank gathers nothing more in it. "raise": one table, waited
        on (a rank still asking for a unit is named now); "gather": rounds until no rank asks for anything."""
        if self.mode == RAISE:
            self._check(self.rounds, self._issue(self.nothing, False))
        else:
            while (first := self._first(self._rows(self._issue(self.nothing, False)))) != self.nothing:
                serve(first)
                self.served += 1

    def _issue(self, unit: int, prefetch: bool) -> Pending:
        """This rank's row, in a table that every rank fills one row of: summed, it holds every rank's row (one
        collective; on gloo an all-gather would be N broadcasts, See [Note: all-gather on gloo])."""
        table = torch.zeros(self.control.world_size * ROW, dtype=torch.int64)  # 1-D, one row per rank
        row = self.control.rank * ROW
        table[row:row + ROW] = torch.tensor([unit + 1, PHASES.index(self.phase), self.micro_step * 2 + prefetch])
        self.rounds += 1
        return self.control.all_reduce(table, op=dist.ReduceOp.SUM, async_op=True,
                                       purpose=f"unit agreement: {self._name(unit)} ({self.phase})")

    def _rows(self, pending: Pending) -> list[tuple[int, int, int, bool]]:
        """(unit, phase, micro-step, prefetch) for every rank."""
        values = wait(pending).tolist()
        rows = [values[r * ROW:(r + 1) * ROW] for r in range(self.control.world_size)]
        return [(unit - 1, phase, code // 2, bool(code % 2)) for unit, phase, code in rows]

    def _check(self, round_: int, pending: Pending) -> None:
        rows = self._rows(pending)
        if len({(unit, phase) for unit, phase, _, _ in rows}) > 1:
            self._raise_first(round_, rows)

    def _raise_first(self, round_: int, rows: list[tuple[int, int, int, bool]]) -> None:
        """Name the earliest round whose rows differ: tables still pending from before this one are older."""
        for earlier, pending in sorted(entry for entry in self.pending.values() if entry[0] < round_):
            earlier_rows = self._rows(pending)
            if len({(unit, phase) for unit, phase, _, _ in earlier_rows}) > 1:
                round_, rows = earlier, earlier_rows
                break
        self.pending.clear()
        raise SkippedUnitError(self._message(round_, rows))

    def _first(self, rows: list[tuple[int, int, int, bool]]) -> int:
        """The unit every rank gathers this round ("gather"): in forward order in forward, reverse in backward."""
        if len({phase for _, phase, _, _ in rows}) > 1:
            raise SkippedUnitError(self._message(self.rounds - 1, rows) + " (the ranks are in different phases)")
        backward = rows[0][1] == PHASES.index("backward")
        return min((unit for unit, _, _, _ in rows),
                   key=lambda u: (u == self.nothing, -u if backward else u))

    def _message(self, round_: int, rows: list[tuple[int, int, int, bool]]) -> str:
        asked = "; ".join(f"rank {rank}: {self._name(unit)} ({PHASES[phase]}{' prefetch' if prefetch else ''}, "
                          f"micro-step {step})" for rank, (unit, phase, step, prefetch) in enumerate(rows))
        return (f"stage 3: the ranks asked for different units at the same gather (unit agreement #{round_ + 1}): "
                f"{asked}. A module that runs on some ranks only must not be its own unit: keep it inside its "
                "parent's unit (name the units with stage3_unit_classes or Stage3Policy.units, or raise "
                "stage3_min_unit_params), or let zerokit gather it on the ranks that skip it with "
                "Stage3Policy(skipped_units=\"gather\") (see [Note: stage-3 units every rank agrees on])")

    def _name(self, unit: int) -> str:
        if unit == self.nothing:
            return "nothing more (it had finished)"
        return "the root unit" if unit == 0 else f"unit {self.units[unit].name!r}"
