"""Pipeline parity: a small language model cut into stages, trained by zerokit.pipeline on a layout of stages x
replicas and, as the reference, whole in one process on the union of every replica's micro-batches.

[Note: what the pipeline reference computes]
One step of the pipeline job: replica r's batch (micro_batches x micro rows) is cut into its micro-batches, each
runs through every stage, and the step's gradient is the mean of the micro-batch losses' gradients over the
micro-batches (the loss divided by m) and the replicas (the data group's average). The reference runs every
replica's micro-batches through the whole model in one process, backpropagates loss / (m x replicas) in fp32,
clips by the global norm (squares summed in float64) and steps the same torch optimizer. The pipeline's partial
sums come in another order, so fp32 agrees to rounding (rtol 1e-5), not bit for bit.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerokit.testing.models import Block, TinyGPTConfig

VOCAB, WIDTH, TIME = 67, 24, 8


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(TIME, WIDTH)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def layers(n_blocks: int = 4) -> list[nn.Module]:
    """The model as a list of layers (embedding, blocks, head), the same values on every rank."""
    torch.manual_seed(1234)
    config = TinyGPTConfig(n_embd=WIDTH, n_head=2, block_size=TIME)
    return [Embed(), *(Block(config) for _ in range(n_blocks)), Head()]


def stage_module(all_layers: list[nn.Module], stage: int, stages: int) -> nn.Module:
    """Stage `stage` of `stages`: a contiguous run of the layers, as even as they split, each named by its index in
    the whole model (as torch's pipeline() tracer names them), so that a checkpoint loads into any layout."""
    bounds = [round(i * len(all_layers) / stages) for i in range(stages + 1)]
    return nn.Sequential(OrderedDict((str(index), copy.deepcopy(all_layers[index]))
                                     for index in range(bounds[stage], bounds[stage + 1])))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1))


def batch(replica: int, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s tokens at `step`: (inputs, targets), each (rows, TIME)."""
    tokens = torch.randint(0, VOCAB, (rows, TIME + 1), generator=torch.Generator().manual_seed(100 * step + replica))
    return tokens[:, :-1], tokens[:, 1:]


@dataclass(frozen=True)
class PipeCase:
    name: str
    stage: int
    schedule: str = "1F1B"
    stages: int = 2
    dtype: str = "fp32"
    micro_batches: int = 4
    micro: int = 2  # rows per micro-batch
    steps: int = 3
    clip: float = 0.05  # small enough that every step clips
    gathering: str = "step"
    n_blocks: int = 4
    # fp16: (stage, replica) whose first step's gradients are made inf (None: none are)
    overflow_at: tuple[int, int] | None = None

    def config(self) -> dict:
        zero = {"stage": self.stage, "reduce_bucket_bytes": 8192}
        if self.stage == 3:
            zero.update(stage3_min_unit_params=1000, stage3_param_persistence_threshold=0)
        precision = {"bf16": {"enabled": True}} if self.dtype == "bf16" else {}
        if self.dtype == "fp16":
            precision = {"fp16": {"enabled": True, "initial_scale_power": 8}}
        return {"zero_optimization": zero, "comm_timeout_seconds": 60, "gradient_clipping": self.clip,
                "train_micro_batch_size_per_gpu": self.micro, "gradient_accumulation_steps": self.micro_batches,
                **precision}


def optimizer_for(module: nn.Module) -> torch.optim.Optimizer:
    # eps 1e-5, not 1e-8: the key bias of attention has an exactly zero gradient (softmax ignores a constant added to
    # every score of a query), which fp32 leaves as noise of ~1e-10 that differs with the order of the sums; Adam
    # with eps 1e-8 turns that noise into steps of lr size, and the comparison into one of noise. With 1e-5 such a
    # step is ~1e-7, while the real gradients (1e-4 and up) are stepped as before.
    return torch.optim.AdamW(module.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-5)


def run_pipeline_cases(rank: int, world_size: int, cases: list[PipeCase], stages_of: dict[str, int] | None = None
                       ) -> dict[str, dict]:
    """Every case on these ranks (each with its own engines, built by all ranks together): per case, the losses
    each step reported and this rank's stage's final weights."""
    import zerokit.pipeline
    from zerokit.parallel.mesh import Layout
    results = {}
    for case in cases:
        layout = Layout.resolve(world_size, pipeline=case.stages)
        stage, replica, _ = layout.coordinates(rank)
        module = stage_module(layers(case.n_blocks), stage, case.stages)
        if case.overflow_at == (stage, replica):
            poison = module[0].register_full_backward_pre_hook(lambda m, grad: (torch.full_like(grad[0], math.inf),))
        pipe = zerokit.pipeline.initialize(module, optimizer_for(module), case.config(), layout,
                                           schedule=case.schedule, loss_fn=lm_loss, stage3_gathering=case.gathering)
        losses, norms, skipped, scales = [], [], [], []
        for step in range(case.steps):
            inputs, target = batch(replica, step, case.micro * case.micro_batches)
            done = pipe.train_step(inputs, target)
            if case.overflow_at == (stage, replica) and step == 0:
                poison.remove()
            losses.append(done.loss.item())
            norms.append(done.result.grad_norm)
            skipped.append(done.result.skipped)
            scales.append(done.result.loss_scale)
        weights = {f"{stage}.{name}": value.float() for name, value in pipe.engine.full_state_dict().items()}
        results[case.name] = {"losses": losses, "norms": norms, "weights": weights, "stage": stage,
                              "skipped": skipped, "scales": scales, "comm": pipe.engine.comm_stats(),
                              "buckets": len(pipe.engine.stage.layout.buckets)}
        pipe.close()
    return results


def reference(case: PipeCase, replicas: int, make_layers=None) -> dict:
    """See [Note: what the pipeline reference computes]: losses, norms and every stage's final weights.
    `make_layers`: the model's layers (default: layers)."""
    all_layers = (make_layers or layers)(case.n_blocks)
    stages = [stage_module(all_layers, s, case.stages) for s in range(case.stages)]
    model = nn.Sequential(*stages)
    optimizers = [optimizer_for(s) for s in stages]  # one per stage: the same param groups as the engines'
    losses, norms = [], []
    for step in range(case.steps):
        total = 0.0
        for replica in range(replicas):
            inputs, target = batch(replica, step, case.micro * case.micro_batches)
            for x, y in zip(inputs.chunk(case.micro_batches), target.chunk(case.micro_batches)):
                loss = lm_loss(model(x), y)
                (loss / (case.micro_batches * replicas)).backward()
                total += loss.item() / (case.micro_batches * replicas)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        coefficient = min(1.0, case.clip / (norm + 1e-6)) if case.clip else 1.0
        for g in grads:
            g.mul_(coefficient)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(norm)
    weights = {f"{s}.{name}": value.detach().clone() for s, module in enumerate(stages)
               for name, value in module.state_dict().items()}
    return {"losses": losses, "norms": norms, "weights": weights}


def refused_shapes(rank: int, world_size: int) -> str:
    """2 stages whose second expects a width the first does not output: the error every rank raises (nothing
    trains)."""
    import zerokit.pipeline
    from zerokit.parallel.mesh import Layout
    layout = Layout.resolve(world_size, pipeline=2)
    stage, replica, _ = layout.coordinates(rank)
    torch.manual_seed(0)
    module = nn.Sequential(Embed()) if stage == 0 else nn.Sequential(nn.Linear(WIDTH + 8, VOCAB))
    before = [p.detach().clone() for p in module.parameters()]
    pipe = zerokit.pipeline.initialize(module, optimizer_for(module), PipeCase("refused", stage=1).config(), layout,
                                       loss_fn=lm_loss)
    try:
        pipe.train_step(*batch(replica, 0, 8))
        message = "trained"
    except ValueError as error:
        message = str(error)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, pipe.engine.full_state_dict().values()))
    pipe.close()
    return message if unchanged else "weights changed: " + message


def refused_batches(rank: int, world_size: int) -> dict[str, Any]:
    """2 micro-batches of 2 rows a step (the config's): what each rank gets for a batch of 12 rows (torch's schedule
    would split it into 2 of 6), 10 (5 and 5), 9 (5 and 4) and a wrong batch on one replica only; whether the weights
    stayed as they were; the outcome of a right batch after them (the ranks still agree). As the DeepSpeed drop-in
    takes its batches (micro_batch_from="batch"): replicas of different rows, then 10 rows (the first step:
    micro-batches of 5), 12, 9 and 10 again."""
    import zerokit.pipeline
    from zerokit.parallel.mesh import Layout
    layout = Layout.resolve(world_size, pipeline=2)
    stage, replica, _ = layout.coordinates(rank)
    case = PipeCase("batches", stage=2, micro_batches=2, micro=2)

    def attempt(pipe: Any, rows: int) -> str:
        try:
            return f"trained {pipe.train_step(*batch(replica, 0, rows)).loss.item():.6f}"
        except ValueError as error:
            return str(error)

    out: dict[str, Any] = {}
    attempts = {"config": (12, 10, 9, "one replica", "unchanged", 4), "batch": ("one replica", 10, 12, 9, "10 again")}
    for source, sequence in attempts.items():
        torch.manual_seed(0)
        module = stage_module(layers(case.n_blocks), stage, 2)
        before = [p.detach().clone() for p in module.parameters()]
        pipe = zerokit.pipeline.initialize(module, optimizer_for(module), case.config(), layout, loss_fn=lm_loss,
                                           micro_batch_from=source)
        out[source] = {}
        for what in sequence:
            if what == "unchanged":
                after = pipe.engine.full_state_dict().values()
                out[source][what] = all(torch.equal(a, b) for a, b in zip(before, after))
                continue
            rows = {"one replica": 4 if replica == 0 else 6, "10 again": 10}.get(what, what)
            out[source][what] = attempt(pipe, rows)
        pipe.close()
    return out


def run_cases_and_refusals(rank: int, world_size: int, cases: list[PipeCase]) -> dict:
    """run_pipeline_cases, then refused_shapes and refused_batches, in one spawn."""
    return {**run_pipeline_cases(rank, world_size, cases), "refused_shapes": refused_shapes(rank, world_size),
            "refused_batches": refused_batches(rank, world_size)}


def resumed(rank: int, world_size: int, directory: str) -> dict[str, list[float]]:
    """ZeRO-2, 1F1B: 4 steps straight, with a save after the second; new engines (a fresh model) that load it and take
    the third; and the layouts crossed: flat ZeRO-3 over every rank loads the save and takes the third step on the
    same micro-batches (See flat_step), saves, and a new pipeline loads that and takes the fourth."""
    import zerokit.pipeline
    from zerokit.parallel.mesh import Layout
    case = PipeCase("resume", stage=2)
    layout = Layout.resolve(world_size, pipeline=2)
    stage, replica, _ = layout.coordinates(rank)

    def build():
        module = stage_module(layers(case.n_blocks), stage, 2)
        return zerokit.pipeline.initialize(module, optimizer_for(module), case.config(), layout, loss_fn=lm_loss)

    def step(pipe, index: int) -> float:
        return pipe.train_step(*batch(replica, index, case.micro * case.micro_batches)).loss.item()

    first = build()
    straight = [step(first, index) for index in range(2)]
    first.save_checkpoint(directory, tag="two")
    straight += [step(first, index) for index in (2, 3)]
    first.close()
    second = build()
    second.load_checkpoint(directory, tag="two")
    again = step(second, 2)
    second.close()
    flat, consolidated = flat_step(rank, world_size, case, directory)
    third = build()
    third.load_checkpoint(f"{directory}-flat")
    back = step(third, 3)
    third.close()
    return {"straight": straight, "resumed": again, "flat": flat, "back": back, "consolidated": consolidated}


def flat_step(rank: int, world_size: int, case: PipeCase, directory: str) -> tuple[float, bool | None]:
    """Flat ZeRO-3 over every rank, on the whole model, loads the pipeline's checkpoint `directory` (tag "two") and
    takes the third step: rank r reads half r % 2 of replica r // 2's rows, in micro-batches of the pipeline's size,
    so the step averages the pipeline's micro-batches. Saves into `directory`-flat; returns the step's loss, averaged
    over the micro-batches and ranks as the pipeline reports it, and consolidated_as_loaded."""
    import zerokit
    replicas = world_size // case.stages
    window = case.micro_batches * replicas // world_size
    model = nn.Sequential(*layers(case.n_blocks))
    config = {**replace(case, stage=3).config(), "gradient_accumulation_steps": window}
    engine = zerokit.initialize(model, optimizer_for(model), config)
    engine.load_checkpoint(directory, tag="two")
    consolidated = consolidated_as_loaded(engine, directory, "two")
    inputs, target = batch(rank // (world_size // replicas), 2, case.micro * case.micro_batches)
    rows = case.micro * window
    half = slice(rank % (world_size // replicas) * rows, (rank % (world_size // replicas) + 1) * rows)
    total = 0.0
    for x, y in zip(inputs[half].chunk(window), target[half].chunk(window)):
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        total += loss.item() / window
    engine.save_checkpoint(f"{directory}-flat")
    engine.close()
    mean = torch.tensor([total])
    torch.distributed.all_reduce(mean)
    return mean.item() / world_size, consolidated


def consolidated_as_loaded(engine, directory: str, tag: str | None = None) -> bool | None:
    """Rank 0: whether the consolidated file of the checkpoint in `directory` (saved per stage or tensor rank) holds
    exactly what `engine` loaded from it, every key of its state dict (None on the other ranks)."""
    from safetensors.torch import load_file

    from zerokit.checkpoint import consolidate
    loaded = engine.full_state_dict()  # every rank: a collective at stage 3
    if torch.distributed.get_rank() != 0:
        return None
    out = Path(directory).parent / f"{Path(directory).name}-consolidated.safetensors"
    consolidate(directory, out, tag=tag)
    whole = load_file(out)
    return whole.keys() == loaded.keys() and all(torch.equal(whole[key], loaded[key]) for key in whole)


def locally_named_refused(rank: int, world_size: int, directory: str) -> str:
    """Stages named locally (a Sequential of each stage's layers: "0.weight" on every stage) save; flat ZeRO loading
    that checkpoint must refuse it rather than take one stage's layer for another's: the one line it raises."""
    import zerokit
    import zerokit.pipeline
    from zerokit.parallel.mesh import Layout
    case = PipeCase("local-names", stage=1)
    layout = Layout.resolve(world_size, pipeline=2)
    stage, _, _ = layout.coordinates(rank)
    module = nn.Sequential(*stage_module(layers(case.n_blocks), stage, 2).children())
    pipe = zerokit.pipeline.initialize(module, optimizer_for(module), case.config(), layout, loss_fn=lm_loss)
    pipe.save_checkpoint(directory)
    pipe.close()
    model = nn.Sequential(*layers(case.n_blocks))
    engine = zerokit.initialize(model, optimizer_for(model), case.config())
    try:
        engine.load_checkpoint(directory)
    except ValueError as error:
        return str(error)
    finally:
        engine.close()
    return ""


class MLPBlock(nn.Module):
    """A residual MLP block: what a tensor group splits inside a stage (its up projection column-wise, its down
    projection row-wise) without the attention's head count in its shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def mlp_layers(n_blocks: int = 4) -> list[nn.Module]:
    torch.manual_seed(1234)
    return [Embed(), *(MLPBlock() for _ in range(n_blocks)), Head()]


def tensor_split_stages(rank: int, world_size: int, cases: list[PipeCase]) -> dict[str, dict]:
    """Per case, a pipeline of 2 stages whose MLP blocks are split over a tensor group of 2 (torch's
    parallelize_module on the layout's tensor mesh; one data replica): the losses and global norms each step
    reported."""
    import zerokit.pipeline
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from zerokit.parallel.mesh import Layout
    layout = Layout.resolve(world_size, pipeline=2, tensor=2)
    stage, replica, _ = layout.coordinates(rank)
    results = {}
    for case in cases:
        module = stage_module(mlp_layers(case.n_blocks), stage, 2)
        plan = {}
        for name, block in module.named_children():
            if isinstance(block, MLPBlock):
                plan.update({f"{name}.up": ColwiseParallel(), f"{name}.down": RowwiseParallel()})
        parallelize_module(module, layout.device_mesh("cpu")["tensor"], plan)
        pipe = zerokit.pipeline.initialize(module, optimizer_for(module), case.config(), layout, loss_fn=lm_loss)
        steps = [pipe.train_step(*batch(replica, step, case.micro * case.micro_batches)) for step in range(case.steps)]
        results[case.name] = {"losses": [done.loss.item() for done in steps],
                              "norms": [done.result.grad_norm for done in steps]}
        pipe.close()
    return results


TENSOR_SPLIT_CASES = [PipeCase("tensor-split-zero1", stage=1), PipeCase("tensor-split-zero3", stage=3)]


def run_cases_refusals_and_resume(rank: int, world_size: int, cases: list[PipeCase], directory: str) -> dict:
    """run_cases_and_refusals, then resumed, locally_named_refused and tensor_split_stages, in one spawn."""
    return {**run_cases_and_refusals(rank, world_size, cases), "resume": resumed(rank, world_size, directory),
            "locally_named": locally_named_refused(rank, world_size, f"{directory}-local"),
            "tensor_split": tensor_split_stages(rank, world_size, TENSOR_SPLIT_CASES)}


def traced_and_hand_split(rank: int, world_size: int) -> dict[str, list[float]]:
    """2 stages x 1 replica at ZeRO-1: the stage modules from torch's pipeline() tracer (split before layer 3),
    and the same cut by hand; each run's losses."""
    import zerokit.pipeline
    from torch.distributed.pipelining import SplitPoint, pipeline
    from zerokit.parallel.mesh import Layout
    layout = Layout.resolve(world_size, pipeline=2)
    stage, replica, _ = layout.coordinates(rank)
    case = PipeCase("traced", stage=1)
    losses = {}
    for name in ("traced", "hand"):
        if name == "traced":
            example = batch(0, 0, case.micro)[0]
            traced = pipeline(nn.Sequential(*layers(case.n_blocks)), mb_args=(example,),
                              split_spec={"3": SplitPoint.BEGINNING})
            module = traced.get_stage_module(stage)
        else:
            module = stage_module(layers(case.n_blocks), stage, 2)
        pipe = zerokit.pipeline.initialize(module, optimizer_for(module), case.config(), layout, loss_fn=lm_loss)
        losses[name] = [pipe.train_step(*batch(replica, step, case.micro * case.micro_batches)).loss.item()
                        for step in range(2)]
        pipe.close()
    return losses
