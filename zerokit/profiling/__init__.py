"""Measured bytes and times in the planner's categories: calibration of a model's activations, the
run recorder, and the plan-vs-run report. Imports torch (the planner itself does not).

`record_run(engine, batches, loss_fn)` records a run; `plan_report(engine)` (or `plan_report(record=...)`)
prints the plan beside it, category by category (docs/planner.md)."""

from zerokit.profiling.record import RunRecord, record_run
from zerokit.profiling.report import plan_report

__all__ = ["RunRecord", "plan_report", "record_run"]
