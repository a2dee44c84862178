"""Stage 3: every rank gathers the same unit at the same point, or every rank hears which unit each asked for.

[Note: stage-3 units every rank agrees on]
A unit is gathered by collectives that every rank must issue in the same order. A unit that runs on some
ranks only (data-dependent control flow: a layer some batches skip, an expert no token of this rank reached)
breaks that: the other ranks' next gather pairs with it, and the job hangs, or, when the sizes happen to
match, computes with another unit's weights without a word (one silently wrong eval output, then an abort,
was what a user saw). So the ranks compare what they gather, on the control group (CPU, gloo; See
Communicator.control): each rank all-reduces (SUM) a table with one row per rank that only its own row fills
(the unit it asks for, the phase: between steps, forward, backward; its micro-step, whether it is a prefetch,
a hash of every unit it asked for so far in this phase, and where it first left the order below). After
that one collective every rank knows what every rank asked for. The end of each forward and of each backward
is always such a row ("nothing more"), waited on, so a rank that asked for anything else in that phase is
named there, not at a timeout. What happens when ranks differ is `Stage3Policy.skipped_units`:

  "raise" (the default) raises SkippedUnitError on every rank, naming the module each rank asked for at the
  first gather where they parted, the phase and the micro-step, before any rank computes with the wrong
  weights. A forward or backward whose kind the ranks last ended in agreement follows that phase's order
  and issues no row but its last: each rank asks for the same units in the same order step after step
  (the order is last step's, prefetches included), so every rank promises, by the last agreement, to issue
  exactly the gathers of that order. A rank whose control flow asks for something else keeps the promise:
  it issues the order's gathers up to the unit it asks for (served: gathered and freed at once, as "gather"
  does below), or, when that unit is not in the rest of the order, all of them and then a row (waited on,
  before its own gather: the others' rows are their end-of-phase ones, and gathers of different sizes must
  never pair: gloo aborts the process, SIGABRT, without a word; NCCL hangs or corrupts). Either way the
  ranks issue the same gathers, every gathered unit is the one its rank asked for, and the end-of-phase
  rows name where each rank first left the order. Ranks that left it alike (the same unit at the same
  gather, and the same units after it: a model whose order changes on every rank at once) agree and go on;
  the next phase of the kind follows the new order. A backward follows its order only after a forward that
  followed its own without leaving it. In backward a rank that must leave the order with a unit not in its
  rest first launches its remaining gradient reductions (`release_reductions`), since another rank may
  wait for one of them before it issues the gathers this rank now waits for; its backward cannot go on after
  that, so it raises even when every rank left alike (then "gather" is the mode for such a model). A phase
  without an order (the first step, gathers between steps, after such a departure) puts a row beside each
  unit gather: when every unit but the root gathers buckets of the same sizes (a stack of equal blocks),
  the row is issued asynchronously beside the unit's gathers and checked right before their data is used
  (two ranks that part gather equal sizes, which pair harmlessly); when units differ in size, each row is
  waited on before the gather starts. (The root is always a phase's first gather on every rank.)

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

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.distributed as dist

from zerokit.comm import Communicator, Pending, wait

if TYPE_CHECKING:
    from zerokit.stages.units import Unit

PHASES = ("between steps", "forward", "backward")
FOLLOWING = ("forward", "backward")  # the phases that follow the order their kind last agreed on ("raise")
RAISE, GATHER = "raise", "gather"
HASH_MODULUS = 2**61 - 1  # a prime; a rank's hash stays inside int64 in the summed table
Request = tuple[int, bool]  # a unit index and whether its gather is a prefetch


class Row(NamedTuple):
    """One rank's row of a table (only its own row is non-zero before the sum)."""
    unit: int  # what it asks for now (len(units): nothing more)
    phase: int  # index into PHASES
    micro_step: int
    prefetch: int
    requests: int  # hash of what it asked for in this phase, in order, this request included
    left_at: int  # the gather of the followed order where it first asked for something else (-1: it did not)
    left_for: int  # what it asked for there
    left_prefetch: int


ROW = len(Row._fields)


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
        self.served = 0  # gathers this rank issued only because another rank asked, or the order promised them
        self.follow_orders = mode == RAISE  # (the benchmark switches it off to time a row beside every gather)
        self.orders: dict[str, list[Request]] = {}  # phase -> its requests, the last time every rank agreed
        self.forward_followed = False  # this micro-step's forward followed its order to the end
        # Launches this rank's remaining gradient reductions without waiting (See the Note and `connect`)
        self.release_reductions: Callable[[], None] | None = None
        self._start_phase()

    def connect(self, release_reductions: Callable[[], None]) -> None:
        """The reducer's launch of every remaining reduction, which a rank leaving the backward's order calls
        (the units' gathers, and so this agreement, exist before the engine builds the reducer over them)."""
        self.release_reductions = release_reductions

    def _start_phase(self) -> None:
        self.started = False  # whether this phase follows an order is decided at its first gather
        self.order: list[Request] | None = None  # the order this phase started to follow
        self.following = False  # it still does: its gathers are the order's, and issue no rows
        self.position = 0  # gathers of the order issued so far
        self.left: tuple[int, Request] | None = None  # where this rank first asked for something else than it
        self.released = False  # its gradient reductions were launched early: this backward cannot go on
        self.requests: list[Request] = []
        self.requests_hash = 0

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            self._start_phase()

    # --- "raise" ---------------------------------------------------------------------------------------------
    def announce(self, unit: int, prefetch: bool, serve: Callable[[int], None]) -> None:
        """Right before the unit's gathers: nothing to say when it is the next gather of the order this phase
        follows (after serving the order's gathers before it, if need be); otherwise its row, checked now or by
        `confirm`."""
        request = (unit, prefetch)
        if self._follows() and self._next_in_order(request, serve):
            return
        self._record(request)
        round_, pending = self.rounds, self._issue(unit, prefetch)
        if self.wait_before_gather or self.left is not None:  # others may be at their end-of-phase row
            self._check(round_, pending)
            if self.released:
                raise SkippedUnitError(_left_alike(unit, self.left[0], self.micro_step, self.units))
        else:
            self.pending[unit] = (round_, pending)

    def confirm(self, unit: int) -> None:
        """Right before the unit's gathered data is waited on or freed: every rank asked for it, or raise."""
        entry = self.pending.pop(unit, None)
        if entry is not None:
            self._check(*entry)

    def _follows(self) -> bool:
        """Whether this phase still follows an order; at its first gather, whether it follows one at all."""
        if not self.started:
            self.started = True
            if self.follow_orders and (self.phase == "forward" or self.phase == "backward" and self.forward_followed):
                self.order = self.orders.get(self.phase)
            self.following = self.order is not None
        return self.following

    def _next_in_order(self, request: Request, serve: Callable[[int], None]) -> bool:
        """True: `request` is (now) the order's next gather, counted as issued. Else this rank asked for something
        else: it serves the order's gathers up to the unit asked for, or all of them when it is not in the rest
        (then False: it goes on with rows; in backward, after releasing its reductions)."""
        rest = [unit for unit, _ in self.order[self.position:]]
        unit = request[0]
        if rest and rest[0] == unit:
            self.position += 1
            self._record(request)
            return True
        if self.left is None:
            self.left = (self.position, request)
        stop = self.position + rest.index(unit) if unit in rest else len(self.order)
        if unit not in rest and unit != self.nothing and self.phase == "backward" and self.release_reductions:
            self.release_reductions()
            self.released = True
        for served in rest[:stop - self.position]:
            serve(served)
            self.served += 1
        self.position = stop
        if unit in rest:
            self.position += 1
            self._record(request)
            return True
        self.following = False
        return False

    def _record(self, request: Request) -> None:
        self.requests.append(request)
        self.requests_hash = (self.requests_hash * 1_000_003 + request[0] + 1) % HASH_MODULUS

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
        """The end of a forward or a backward: this rank gathers nothing more in it. "raise": the rest of the
        order it follows, served, and one table, waited on (a rank that asked for anything else is named now);
        "gather": rounds until no rank asks for anything."""
        if self.mode == RAISE:
            if self._follows() and self.position < len(self.order):
                self._next_in_order((self.nothing, False), serve)
            self._check(self.rounds, self._issue(self.nothing, False))
            if self.phase in FOLLOWING:
                self.orders[self.phase] = self.requests
            if self.phase == "forward":
                self.forward_followed = self.order is not None and self.left is None
        else:
            while (first := self._first(self._rows(self._issue(self.nothing, False)))) != self.nothing:
                serve(first)
                self.served += 1
        self._start_phase()

    def _issue(self, unit: int, prefetch: bool) -> Pending:
        """This rank's row, in a table that every rank fills one row of: summed, it holds every rank's row (one
        collective; on gloo an all-gather would be N broadcasts, See [Note: all-gather on gloo])."""
        table = torch.zeros(self.control.world_size * ROW, dtype=torch.int64)  # 1-D, one row per rank
        left_at, (left_for, left_prefetch) = self.left if self.left is not None else (-1, (-1, False))
        row = Row(unit, PHASES.index(self.phase), self.micro_step, int(prefetch), self.requests_hash, left_at,
                  left_for, int(left_prefetch))
        table[self.control.rank * ROW:(self.control.rank + 1) * ROW] = torch.tensor(row)
        self.rounds += 1
        return self.control.all_reduce(table, op=dist.ReduceOp.SUM, async_op=True,
                                       purpose=f"unit agreement: {_name(unit, self.units)} ({self.phase})")

    def _rows(self, pending: Pending) -> list[Row]:
        values = wait(pending).tolist()
        return [Row(*values[r * ROW:(r + 1) * ROW]) for r in range(self.control.world_size)]

    def _check(self, round_: int, pending: Pending) -> None:
        rows = self._rows(pending)
        if len({(row.unit, row.phase, row.requests) for row in rows}) > 1:
            self._raise_first(round_, rows)

    def _raise_first(self, round_: int, rows: list[Row]) -> None:
        """Name the earliest round whose rows differ: tables still pending from before this one are older."""
        for earlier, pending in sorted(entry for entry in self.pending.values() if entry[0] < round_):
            earlier_rows = self._rows(pending)
            if len({(row.unit, row.phase, row.requests) for row in earlier_rows}) > 1:
                round_, rows = earlier, earlier_rows
                break
        self.pending.clear()
        raise SkippedUnitError(_message(round_, rows, self.units, self.order))

    def _first(self, rows: list[Row]) -> int:
        """The unit every rank gathers this round ("gather"): in forward order in forward, reverse in backward."""
        if len({row.phase for row in rows}) > 1:
            raise SkippedUnitError(_message(self.rounds - 1, rows, self.units, self.order)
                                   + " (the ranks are in different phases)")
        backward = rows[0].phase == PHASES.index("backward")
        return min((row.unit for row in rows), key=lambda u: (u == self.nothing, -u if backward else u))


# --- what the errors say -------------------------------------------------------------------------------------
def _message(round_: int, rows: list[Row], units: list["Unit"], order: list[Request] | None) -> str:
    """Where the ranks first left the order they followed, if they did; else what each asks for now."""
    departures = [row.left_at for row in rows if row.left_at >= 0]
    if departures:
        first = min(departures)
        asked = [_asked_at(first, row, order, len(units)) for row in rows]
        where = f"{PHASES[rows[0].phase]} gather #{first + 1} of the order the ranks last agreed on"
        if len(set(asked)) == 1:
            where += ", where they agree; they part after it"
    else:
        asked = [(row.unit, row.phase, row.micro_step, row.prefetch) for row in rows]
        where = f"unit agreement #{round_ + 1}"
    listed = "; ".join(f"rank {rank}: {_name(unit, units)} ({PHASES[phase]}{' prefetch' if prefetch else ''}, "
                       f"micro-step {step})" for rank, (unit, phase, step, prefetch) in enumerate(asked))
    return (f"stage 3: the ranks asked for different units at the same gather ({where}): {listed}. A module "
            "that runs on some ranks only must not be its own unit: keep it inside its parent's unit (name the "
            "units with stage3_unit_classes or Stage3Policy.units, or raise stage3_min_unit_params), or let "
            "zerokit gather it on the ranks that skip it with Stage3Policy(skipped_units=\"gather\") (see "
            "[Note: stage-3 units every rank agrees on])")


def _asked_at(position: int, row: Row, order: list[Request] | None, nothing: int) -> tuple[int, int, int, int]:
    """What a rank asked for at the order's gather `position`: the order's own, unless it left there."""
    if row.left_at == position:
        return row.left_for, row.phase, row.micro_step, row.left_prefetch
    unit, prefetch = order[position] if order and position < len(order) else (nothing, False)
    return unit, row.phase, row.micro_step, int(prefetch)


def _left_alike(unit: int, position: int, micro_step: int, units: list["Unit"]) -> str:
    return (f"stage 3: every rank's backward (micro-step {micro_step}) asked for {_name(unit, units)} at "
            f"gather #{position + 1}, which the last backward did not gather then or after it. "
            "skipped_units=\"raise\" follows the last backward's order and cannot go on once a rank leaves it "
            "for a unit outside it (its gradient reductions were released: see [Note: stage-3 units every "
            "rank agrees on]); for a model whose backward order changes between steps on every rank, use "
            "Stage3Policy(skipped_units=\"gather\")")


def _name(unit: int, units: list["Unit"]) -> str:
    if unit == len(units):
        return "nothing more (it had finished)"
    return "the root unit" if unit == 0 else f"unit {units[unit].name!r}"
