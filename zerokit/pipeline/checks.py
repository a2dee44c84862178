"""What a pipeline is refused for, or warned about, before anything trains: each a one-line message naming the
problem and what is accepted, raised identically on every rank (every rank checks the same arguments)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

from zerokit.comm.agreement import min_max
from zerokit.parallel.mesh import Layout

SCHEDULES = ("GPipe", "1F1B")
GATHERINGS = ("step", "micro_batch")  # See [Note: stage 3 under a pipeline: gather once per step, or per micro-batch]
MICRO_BATCH_SOURCES = ("config", "batch")  # See [Note: a pipeline batch is checked on every rank] in engine.py


class BubbleWarning(UserWarning):
    """Fewer micro-batches than stages: most of each step is the pipeline filling and draining."""


def check_pipeline_arguments(layout: Layout, loss_fn: Callable[..., Any] | None, gathering: str,
                             micro_batch_from: str = "config") -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a zerokit.Layout (Layout.resolve(world_size, pipeline=...)), got "
                        f"{type(layout).__name__}")
    if loss_fn is None:
        raise ValueError("a pipeline needs loss_fn(output, target), the last stage's loss of one micro-batch")
    if gathering not in GATHERINGS:
        raise ValueError(f"stage3_gathering={gathering!r} is not one of {GATHERINGS}")
    if micro_batch_from not in MICRO_BATCH_SOURCES:
        raise ValueError(f"micro_batch_from={micro_batch_from!r} is not one of {MICRO_BATCH_SOURCES}")


def check_tied(config: Any, tied: list) -> None:
    """Weights tied across stages are summed where gradients accumulate whole (See [Note: a tied weight's gradient
    across stages] in zerokit/pipeline/tied.py)."""
    if not tied:
        return
    keys = sorted({t.key for t in tied})
    if config.stage == 3:
        raise ValueError(f"weights tied across pipeline stages ({', '.join(keys)}) are not supported at ZeRO-3, whose "
                         "gradient shards do not line up across stages; accepted: ZeRO stages 0-2, or the tied "
                         "layers on one stage")
    if config.stage == 2 and config.reduce_every_micro_step:
        raise ValueError(f"weights tied across pipeline stages ({', '.join(keys)}) need ZeRO-2 to reduce once per "
                         "step; accepted: zero_optimization.reduce_every_micro_step false (the pipeline's default)")


def schedule_class_of(schedule: str | type) -> type:
    """torch's schedule class for a name ("GPipe", "1F1B") or the class itself, if it is one we drive."""
    from torch.distributed import pipelining  # here: it imports torch._dynamo (See pipeline/stage.py)
    classes = {"GPipe": pipelining.ScheduleGPipe, "1F1B": pipelining.Schedule1F1B}
    if isinstance(schedule, str):
        found = {name.lower(): cls for name, cls in classes.items()}.get(schedule.lower())
    else:
        found = schedule if schedule in classes.values() else None
    if found is None:
        name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", repr(schedule))
        raise ValueError(f"the pipeline schedule {name!r} is not supported with zerokit engines; accepted: "
                         f"{', '.join(SCHEDULES)} (torch's ScheduleGPipe, Schedule1F1B)")
    return found


def bubble_fraction(micro_batches: int, stages: int) -> float:
    """The share of a GPipe/1F1B step each stage idles: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def warn_about_the_bubble(micro_batches: int, stages: int) -> None:
    if micro_batches < stages:
        warnings.warn(f"{micro_batches} micro-batch(es) per step on {stages} pipeline stages: the bubble is "
                      f"{bubble_fraction(micro_batches, stages):.0%} of each step ((p-1)/(m+p-1)); use at least "
                      f"{stages} micro-batches (gradient_accumulation_steps), several times that to keep it small",
                      BubbleWarning, stacklevel=3)


def check_sequence_stages(stage_module: Any, layout: Layout) -> None:
    """With a sequence dimension, before any engine is built: every stage's module has Hugging Face attention that
    Ulysses can split (See zerokit/parallel/sequence/attention.py). Each stage holds other layers, so a stage's
    problem is found on its ranks alone; every rank learns the first stage's, and raises it, instead of the other
    stages waiting for that stage's engine until the group's timeout."""
    if layout.sequence == 1:
        return
    import torch.distributed as dist
    from zerokit.parallel.sequence.attention import check_attachable
    stage = layout.coordinates(dist.get_rank()).stage
    problem = None
    try:
        check_attachable(stage_module, layout.sequence, layout.tensor)
    except ValueError as error:
        problem = f"pipeline stage {stage}: {error}"
    problems: list[Any] = [None] * dist.get_world_size()
    # Python objects, once, at start-up, before the engine's groups exist: a pickled all-gather over the job
    dist.all_gather_object(problems, problem)
    first = next((each for each in problems if each), None)
    if first:
        raise ValueError(first)


def check_stage_shapes(engine: Any, stage_index: int, num_stages: int, first_inputs: Any,
                       check_output: Callable[[Any], Any] | None = None) -> None:
    """Before the first step: each stage runs one forward (no gradients) on what the stage before it outputs for the
    first micro-batch, stage after stage, and every rank learns the outcome. A stage that does not accept its
    input (a width the next stage's first layer was not built for, say) is then one ValueError naming both stages
    and the shapes, on every rank, before anything trains, instead of an error on one rank while the others wait
    for it in the schedule's point-to-point exchanges until the group's timeout. `check_output`: run by the last
    stage on its output (the loss of the first micro-batch), whose error every rank learns alike."""
    import torch
    import torch.distributed as dist
    group = engine.stages_comm.group
    ranks = dist.get_process_group_ranks(group)
    received = first_inputs
    for sender in range(num_stages):
        message: list[Any] = [None]
        if stage_index == sender:
            message = [_probe(engine.module, received, sender, check_output if sender == num_stages - 1 else None)]
        # Python objects, once, at start-up: a pickled broadcast on the pipeline group (nothing in comm/ sends objects)
        dist.broadcast_object_list(message, src=ranks[sender], group=group)
        outcome, value = message[0]
        if outcome == "error":
            raise ValueError(value)
        if stage_index == sender + 1:
            received = tuple(torch.zeros(shape, dtype=dtype, device=engine.device) for shape, dtype in value)


def check_step_batch(engine: Any, first: bool, last: bool, inputs: Any, target: Any, micro_batches: int,
                     micro_rows: int | None, source: str) -> int:
    """Before a step's schedule runs, on every rank: the first stage's inputs and the last stage's target hold
    micro_batches x micro_rows rows on every replica (micro_rows None: the same multiple of micro_batches on every
    replica), as torch's schedule splits dim 0 into the micro-batches. Otherwise one ValueError naming the rows given
    and the rows expected (`source`: what makes micro_rows), raised on every rank before anything runs (See
    [Note: a pipeline batch is checked on every rank] in engine.py). Returns the rows of a micro-batch. Two
    all-reduces of a few integers, counted apart from the model's traffic (control)."""
    rows = [_rows(inputs) if first else -1, _rows(target) if last else -1]
    if engine.stages_comm is not None:  # the first stage's rows and the last stage's, on every stage of the pipeline
        _, rows = min_max(engine.stages_comm.control, rows, purpose="a pipeline step's batch rows, over the stages")
    lowest, highest = min_max(engine.comm.control, rows, purpose="a pipeline step's batch rows, over the replicas")
    for what, low, high in (("inputs (first stage)", lowest[0], highest[0]),
                            ("target (last stage)", lowest[1], highest[1])):
        expected, why = micro_batches * (micro_rows or 0), source
        if micro_rows is None:  # the first step: every replica's micro-batches of one size, which later steps keep
            expected = max(low, 0)
            why = f"another replica passes {low} rows (every replica's micro-batches are one size)"
        for given in sorted({low, high}):
            problem = _batch_problem(what, given, expected, micro_batches, why)
            if problem:
                raise ValueError(problem)
    return max(highest) // micro_batches


def _rows(batch: Any) -> int:
    """Rows along dim 0 (the first tensor's, for a tuple of inputs); -1 for none."""
    import torch
    parts = batch if isinstance(batch, (tuple, list)) else (batch,)
    tensors = [part for part in parts if isinstance(part, torch.Tensor)]
    return tensors[0].shape[0] if tensors and tensors[0].dim() else -1


def _batch_problem(what: str, rows: int, expected: int, micro_batches: int, why: str) -> str | None:
    """What is wrong with a step's `rows` (-1: a stage that passed none, which torch's schedule names itself)."""
    if rows < 0:
        return None
    if rows % micro_batches or rows == 0:
        return (f"a pipeline step's {what} hold {rows} rows on a replica, which do not split into "
                f"gradient_accumulation_steps={micro_batches} equal micro-batches: pass a multiple of "
                f"{micro_batches} rows per replica, or set train_micro_batch_size_per_gpu")
    if rows != expected:
        return f"a pipeline step's {what} hold {rows} rows on a replica, but {why}: pass {expected} rows per replica"
    return None


def _probe(module: Any, inputs: Any, stage: int, check_output: Callable[[Any], Any] | None) -> tuple[str, Any]:
    import torch
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    try:
        with torch.no_grad():
            output = module(*args)
    except Exception as error:  # the user's module, any error: reported on every rank as one line
        source = "the first micro-batch's inputs" if stage == 0 else f"stage {stage - 1}'s output"
        return "error", (f"pipeline stage {stage} does not accept {source} of shape(s) {shapes}: {_reason(error)}; "
                         "accepted: the shapes its first layer was built for")
    if check_output is not None:
        try:
            with torch.no_grad():
                check_output(output)
        except Exception as error:  # the user's loss function, any error: reported on every rank as one line
            return "error", f"pipeline stage {stage}'s loss_fn failed on the first micro-batch: {_reason(error)}"
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    return "ok", [(tuple(t.shape), t.dtype) for t in outputs if isinstance(t, torch.Tensor)]


def _reason(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
