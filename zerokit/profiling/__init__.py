"""Measured bytes and times in the planner's categories: calibration of a model's activations, the
run recorder, and the plan-vs-run report. Imports torch (the planner itself does not)."""
