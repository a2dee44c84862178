"""Pipeline parallelism composed with ZeRO: torch's schedules across the stages, a zerokit engine over each stage's
data group (zerokit.pipeline.initialize). See zerokit/pipeline/engine.py."""

from zerokit.pipeline.checks import BubbleWarning, bubble_fraction
from zerokit.pipeline.engine import PipelineEngine, PipelineStep, initialize

__all__ = ["BubbleWarning", "PipelineEngine", "PipelineStep", "bubble_fraction", "initialize"]
