"""A pipeline of zerokit engines: this rank's stage of the model, under an engine over its stage's data group,
driven by one of torch's schedules; one call trains one optimizer step.

One step, in order: (stage 3, gathering "step": every unit of the stage gathered) -> the schedule's forwards and
backwards over gradient_accumulation_steps micro-batches, each backward reduced as engine.backward would (See
[Note: a pipeline stage's engine] in stage.py) -> the loss, as DeepSpeed's train_batch reports it -> engine.step():
the norm and overflow agreed over every stage and replica (See [Note: one norm across the pipeline] in engine/step.py),
clipping, the optimizer on this rank's shards.

[Note: stage 3 under a pipeline: gather once per step, or per micro-batch]
A schedule runs m micro-batches per step through each stage, several of them in flight at once (1F1B holds up to
p forwards before their backwards). Stage 3 can either gather a stage's parameters once for the whole step and
keep them until the optimizer step ("step": ZeRO-3's sharded states with ZeRO-2's parameter memory during the
step, as torchtitan runs FSDP2 under a pipeline, reshard_after_forward=False), or gather every unit for each
micro-batch's forward and again for its backward, freeing it after each ("micro_batch": parameter memory of one
unit, but 2m all-gathers of the stage's parameters per step instead of one). The planner prices both
(Training.stage3_gathering in zerokit/planner/spec.py); "step" is the default because a pipeline's m is large where
the bubble is small.

[Note: a pipeline's loss over a sequence split across ranks]
With a sequence dimension (Layout.resolve(world, pipeline=p, sequence=s), or the config's sequence_parallel_size
beside a pipeline layout), each sequence rank of the last stage holds the logits of its shard of every micro-batch,
while the micro-batch's loss is the replica's mean over all its target tokens, which no rank can take alone. So
loss_fn returns this rank's TokenLosses (its tokens' summed loss and their count of targets: next_token_losses, or
any per-token loss summed) and the pipeline combines them over the stage's sequence group: the sums and the counts
added over the ranks (See [Note: one loss over a sequence split across ranks] in parallel/sequence/batch.py). The
pipeline combines, not loss_fn, because the sequence group is made inside initialize, after loss_fn is given; and
TokenLosses without a sequence dimension are the mean over the micro-batch's targets, so one loss_fn serves both.
The backward of the sum hands each sequence rank's sum the whole gradient; it flows back through that rank's own
pipeline (the same sequence index on every stage: Layout.pipeline_groups, the group torch's PipelineStage sends
over), and ZeRO's average over the stage's data group (replicas x sequence ranks) makes it one process's gradient.
torch's schedule calls loss_fn once more at the first step, on the output of a forward made to learn the shapes
(PipelineStage's backward metadata inference), and backpropagates it for the input gradients' shapes: that call
combines too, with the collectives of its forward and backward on every sequence rank of the last stage at the same
point, so they pair up; its result trains nothing. A mean over this rank's tokens (a plain tensor) is refused under a
sequence degree, found on the last stage's probe of the first micro-batch, on every rank (See check_stage_shapes): it
would weigh shards with different counts of targets as equals. The reported loss needs nothing more: every sequence
rank holds its replica's loss, so the average over the data group is still the mean over the replicas.

[Note: a pipeline batch is checked on every rank]
torch's schedule splits the first stage's inputs and the last stage's target along dim 0 into the step's micro-batches
(tensor_split: as evenly as it can). A batch of 12 rows under a config of 2 micro-batches of 2 would train as 2
micro-batches of 6, silently; 10 rows would fail on the last stage (its target split apart from the activations it
receives) while the other stages waited in their sends until the group's timeout. So before each step's schedule
every rank learns the rows the first and last stages hold on every replica (check_step_batch: two small all-reduces
over the pipeline and the data group, counted apart from the model's traffic) and a batch that is not
gradient_accumulation_steps x train_micro_batch_size_per_gpu rows is one ValueError on every rank, naming both,
before anything runs. The micro-batch size is enforced where the config fixes it (the key, or train_batch_size,
from which it is derived); where nothing does, the first step's batch decides it (the same multiple of the micro-batch
count on every replica, split into equal micro-batches), and later steps keep it: torch's pipeline stages keep the
shapes of their first step, and a step of another size hung in their sends. The DeepSpeed drop-in takes the second
way whatever the config says (micro_batch_from="batch"), as DeepSpeed's train_batch trains the micro-batches its data
iterator yields.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import nn

from zerokit.comm.process import ensure_process_group
from zerokit.engine.engine import Engine, Optimizers, initialize as initialize_engine
from zerokit.parallel.mesh import Layout
from zerokit.parallel.sequence.batch import TokenLosses, combined_loss
from zerokit.parallel.sequence.share import with_sequence_degree
from zerokit.pipeline.checks import (check_pipeline_arguments, check_sequence_stages, check_stage_shapes,
                                     check_step_batch, check_tied, schedule_class_of, warn_about_the_bubble)
from zerokit.pipeline.stage import engine_stage
from zerokit.pipeline.tied import TiedWeight, TiedWeights
from zerokit.precision.result import StepResult


class PipelineStep(NamedTuple):
    loss: torch.Tensor | None
    """The step's mean loss over its micro-batches and replicas, on every rank (DeepSpeed's train_batch's);
    None from eval steps without a loss function."""
    result: StepResult
    """The engine's report of the optimizer step (skipped, norm, loss scale, ...)."""


class PipelineEngine:
    """This rank's stage under a zerokit engine, driven by a torch schedule (build it with
    zerokit.pipeline.initialize)."""

    def __init__(self, engine: Engine, layout: Layout, schedule_class: type, loss_fn: Callable[..., torch.Tensor],
                 gathering: str, tied: TiedWeights, micro_rows: int | None) -> None:
        self.engine, self.layout, self.tied = engine, layout, tied
        # See [Note: a pipeline batch is checked on every rank]
        self.micro_rows, self.micro_rows_from_config = micro_rows, micro_rows is not None
        self.stage_index, self.replica, _ = layout.coordinates(torch.distributed.get_rank())
        self.num_stages = layout.pipeline
        self.micro_batches = engine.config.gradient_accumulation_steps
        self.loss_fn, self.gathering = loss_fn, gathering
        self.stage = engine_stage(engine, self.stage_index, self.num_stages, defer_reduction=bool(tied))
        index_of = {id(param): index for index, param in enumerate(engine.stage.flat.params)}
        engine.stepper.exclude_from_norm({index_of[id(t.weight)] for t in tied.counted_elsewhere()})
        tied_ids = {id(t.weight) for t in tied.tied}
        engine.tied_names = frozenset(name for name, p in engine.module.named_parameters() if id(p) in tied_ids)
        # id of what backward starts from -> the user's loss it came from (last stage; See _scaled_loss)
        self._unscaled: dict[int, torch.Tensor] = {}
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses, as the user's loss_fn gave them
        self._shapes_checked = False  # See check_stage_shapes
        self.schedule = schedule_class(self.stage, self.micro_batches, loss_fn=self._scaled_loss, scale_grads=False)
        self.eval_schedule = schedule_class(self.stage, self.micro_batches, loss_fn=None, scale_grads=False)

    def is_first_stage(self) -> bool:
        return self.stage_index == 0

    def is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        """What backward starts from: the user's loss of one micro-batch divided by the micro-batch count (the
        window's average) and multiplied by the fp16 loss scale. The user's loss is kept for the report under the
        result's id: torch's schedule also calls the loss function once on placeholder tensors, to learn the
        gradients' shapes, and only the results it returns in `losses` are the micro-batches'."""
        loss = self._micro_batch_loss(self.loss_fn(output, target))
        scaled = loss * (self.engine.loss_scaler.scale / self.micro_batches)
        self._unscaled[id(scaled)] = loss.detach().float()
        return scaled

    def _micro_batch_loss(self, given: Any) -> torch.Tensor:
        """The loss of one micro-batch from what loss_fn returned: a tensor as it is; TokenLosses (a summed loss and
        its count of targets) as the mean over the replica's targets, combined over its sequence ranks where there
        are any (See [Note: a pipeline's loss over a sequence split across ranks])."""
        sequence = self.engine.sequence
        if isinstance(given, tuple) and len(given) == 2:
            return combined_loss(TokenLosses(*given), None if sequence is None else sequence.group)
        if sequence is not None:
            raise ValueError(f"with {sequence.ranks} sequence ranks, loss_fn must return this rank's TokenLosses (its "
                             "tokens' summed loss and their count of targets: zerokit.parallel.sequence."
                             f"next_token_losses), not {type(given).__name__}: a mean over each rank's tokens weighs "
                             "shards with different counts of targets wrongly")
        return given

    def train_step(self, inputs: Any = None, target: Any = None) -> PipelineStep:
        """One optimizer step over this replica's batch: `inputs` (first stage; split along dim 0 into the micro-
        batches) and `target` (last stage); the other stages pass nothing."""
        self._check_batch(inputs, target)
        self._check_shapes(inputs, target)
        keep = self.engine.config.stage == 3 and self.gathering == "step"
        scaled: list[torch.Tensor] = []
        with self.engine.unsharded() if keep else nullcontext():
            self._run(self.schedule, inputs, target, scaled)
        if self.tied:  # See [Note: a tied weight's gradient across stages] in tied.py
            self.tied.sum_gradients()
            self.engine.reduce_deferred()
        self._losses = [self._unscaled[id(loss)] for loss in scaled]
        self._unscaled.clear()
        loss = self._reported_loss()
        return PipelineStep(loss, self.engine.step())

    def eval_step(self, inputs: Any = None, target: Any = None) -> torch.Tensor:
        """The mean loss of one batch, without gradients, on every rank (DeepSpeed's eval_batch)."""
        self._losses = []
        self._check_batch(inputs, target)
        self._check_shapes(inputs, target)
        with torch.no_grad():
            output = self._run(self.eval_schedule, inputs, None, None)
            if self.is_last_stage():
                chunks = output.chunk(self.micro_batches) if isinstance(output, torch.Tensor) else output
                targets = target.chunk(self.micro_batches)
                self._losses = [self._micro_batch_loss(self.loss_fn(o, t)).detach().float()
                                for o, t in zip(chunks, targets)]
        return self._reported_loss()

    def _check_batch(self, inputs: Any, target: Any) -> None:
        """See [Note: a pipeline batch is checked on every rank]."""
        m, rows = self.micro_batches, self.micro_rows
        source = (f"the config makes each step gradient_accumulation_steps={m} micro-batches of "
                  f"train_micro_batch_size_per_gpu={rows} rows" if self.micro_rows_from_config else
                  f"this pipeline's first step ran gradient_accumulation_steps={m} micro-batches of {rows} rows, and "
                  "torch's pipeline stages keep the shapes of their first step")
        agreed = check_step_batch(self.engine, self.is_first_stage(), self.is_last_stage(), inputs, target, m, rows,
                                  source)
        self.micro_rows = agreed  # the first step's, where the config fixes none

    def _check_shapes(self, inputs: Any, target: Any) -> None:
        """Once, before the first step: every stage accepts what the one before it outputs, and under sequence
        parallelism the last stage's loss_fn returns what can be combined over its sequence ranks (See
        check_stage_shapes)."""
        if self._shapes_checked or self.num_stages == 1:
            return
        first, check_output = None, None
        if self.is_first_stage():
            parts = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            first = tuple(part.tensor_split(self.micro_batches)[0] for part in parts)
        if self.is_last_stage() and self.engine.sequence is not None and target is not None:
            first_target = target.tensor_split(self.micro_batches)[0]

            def check_output(output: Any) -> None:  # the first micro-batch's loss, combined over the sequence ranks
                self._micro_batch_loss(self.loss_fn(output, first_target))
        check_stage_shapes(self.engine, self.stage_index, self.num_stages, first, check_output)
        self._shapes_checked = True

    def _run(self, schedule: Any, inputs: Any, target: Any, losses: list | None) -> Any:
        """A tuple of inputs goes to the first stage as that many arguments, each split into the micro-batches."""
        args = () if inputs is None or not self.is_first_stage() else (
            tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))
        kwargs = {"target": target, "losses": losses} if self.is_last_stage() and target is not None else {}
        return schedule.step(*args, **kwargs)

    def _reported_loss(self) -> torch.Tensor:
        """DeepSpeed's: the last stage's mean over the micro-batches, averaged over its data group, then broadcast
        to every stage."""
        loss = torch.zeros((), dtype=torch.float32, device=self.engine.comm.device)
        if self.is_last_stage():
            loss += torch.stack(self._losses).mean().to(loss.device)
            self.engine.comm.all_reduce(loss, op=torch.distributed.ReduceOp.SUM, purpose="the step's loss, averaged "
                                        "over the replicas")
            loss /= self.engine.comm.world_size
        if self.engine.stages_comm is not None:
            self.engine.stages_comm.broadcast(loss, src=self.num_stages - 1, purpose="the step's loss, from the last "
                                              "stage")
        return loss

    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None,
                        client_state: dict[str, Any] | None = None) -> bool:
        """Every stage saves its engine's checkpoint under save_dir/stage<s>/tag, with its replicas (every rank calls
        it): each is a zerokit checkpoint, and together they load into any layout (See [Note: a checkpoint per stage
        and tensor rank, read as one] in zerokit/checkpoint/relayout.py)."""
        return self.engine.save_checkpoint(save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None) -> tuple[str, dict[str, Any] | None]:
        """The inverse of save_checkpoint, from a checkpoint of any layout: this pipeline's (any replicas, any ZeRO
        stage), another pipeline's, or flat ZeRO's."""
        return self.engine.load_checkpoint(load_dir, tag)

    def comm_stats(self) -> dict[str, Any]:
        """The stage engine's collectives (engine.comm_stats()), and the bytes of activations and their gradients
        this rank sent to its neighbouring stages (torch's point-to-point sends, counted as the schedule makes them)."""
        return {**self.engine.comm_stats(), "pipeline_sends": {"bytes": self.stage.sent_bytes}}

    def close(self) -> None:
        self.tied.close()
        self.engine.close()


def reduced_once_per_step(config: Any) -> Any:
    """The config with stage 2 reducing once per optimizer step, at the window's last micro-batch, unless it says
    otherwise: a pipeline step has many micro-batches, and reducing each would send the stage's gradients m times
    (stages 0-1 reduce once anyway; stage 3 must reduce every micro-batch, its gradients have nowhere else to go)."""
    from zerokit.config.typed import load_config, read_json_object
    if isinstance(config, (str, Path)):
        config = read_json_object(config, "config file")
    if isinstance(config, Mapping):
        zero = dict(config.get("zero_optimization") or {})
        if zero.get("stage") == 2 and "reduce_every_micro_step" not in zero:
            zero["reduce_every_micro_step"] = False
            config = {**config, "zero_optimization": zero}
    return load_config(config)


def initialize(stage_module: nn.Module, optimizer: Optimizers | None, config: Any, layout: Layout,
               schedule: str | type = "1F1B", loss_fn: Callable[..., torch.Tensor] | None = None,
               stage3_gathering: str = "step", device: torch.device | None = None,
               tied: list[TiedWeight] | None = None, micro_batch_from: str = "config") -> PipelineEngine:
    """This rank's stage (`stage_module`: the part of the model its pipeline stage runs, layout.coordinates(rank)
    .stage) under a zerokit engine over its stage's data group, driven by torch's `schedule` ("GPipe", "1F1B", or
    the class). The config's gradient_accumulation_steps is the schedule's micro-batch count. Every rank calls it at
    the same point. `layout` with a sequence degree (or the config's sequence_parallel_size beside it): each stage's
    sequences split over its sequence ranks, Ulysses attached to the stage's Hugging Face attention (See
    docs/pipeline.md). `loss_fn(output, target)`: the last stage's loss of one micro-batch, a tensor or this rank's
    TokenLosses, which a sequence degree needs (See [Note: a pipeline's loss over a sequence split across ranks]).
    `stage3_gathering`: "step" or "micro_batch" (See [Note: stage 3 under a pipeline: gather once per step, or per
    micro-batch]). `tied`: this stage's copies of weights tied across stages, with their groups (See [Note: a tied
    weight's gradient across stages] in tied.py); the copies take the first stage's values here. `micro_batch_from`:
    "config" (a step's batch must be the config's micro-batches: See [Note: a pipeline batch is checked on every
    rank]) or "batch" (the first step's batch, split evenly, decides them: DeepSpeed's train_batch, whose iterator
    gives the micro-batches)."""
    check_pipeline_arguments(layout, loss_fn, stage3_gathering, micro_batch_from)
    schedule_class = schedule_class_of(schedule)
    config = reduced_once_per_step(config)
    layout = _with_sequence_ranks(stage_module, layout, config.sequence_parallel_size)
    # the micro-batch size the config fixes: its own key, or train_batch_size's (resolve derives it); else none
    fixed = micro_batch_from == "config" and (config.train_micro_batch_size_per_gpu is not None
                                             or config.train_batch_size is not None)
    check_tied(config, tied or [])
    tied_weights = TiedWeights(tied or [], config.comm_timeout_seconds)
    tied_weights.synchronize()  # before the engine copies the weights into its masters
    engine = initialize_engine(stage_module, optimizer, config, device=device, layout=layout)
    warn_about_the_bubble(engine.config.gradient_accumulation_steps, layout.pipeline)
    micro_rows = engine.config.train_micro_batch_size_per_gpu if fixed else None
    return PipelineEngine(engine, layout, schedule_class, loss_fn, stage3_gathering, tied_weights, micro_rows)


def _with_sequence_ranks(stage_module: nn.Module, layout: Layout, degree: int) -> Layout:
    """The layout with the config's sequence degree (its pipeline and tensor degrees kept), and every stage's module
    checked for attention to split, on every rank, before any engine is built (See check_sequence_stages)."""
    if degree <= 1 and layout.sequence == 1:
        return layout
    ensure_process_group()
    layout = with_sequence_degree(layout, degree)
    check_sequence_stages(stage_module, layout)
    return layout
