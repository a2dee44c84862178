"""Pipeline parallelism composed with Ulysses sequence parallelism, against one process on the whole model and the
whole sequences.

A small Hugging Face Llama (sdpa, grouped-query attention: 4 query heads, 2 key/value heads; fp32; 2 decoder layers)
is cut into 2 pipeline stages by decoder layers, each stage's sequences split over 2 sequence ranks: 4 ranks, one
replica, one spawn for every case. Each stage module makes its tokens' positions from the layout's sequence index
(shard_position_ids); the last stage's loss_fn returns next_token_losses, which the pipeline combines over the
sequence ranks. ZeRO stages 1-3, AdamW and SGD (Adam's normalised step would hide a gradient off by a constant
factor), 1F1B and GPipe, the sequence degree from the layout or from the config's sequence_parallel_size, clipping at
a norm the gradients pass, 2 micro-batches a step; the prompts are masked, all in the first shard, so that the two
shards of a sequence count different targets (a mean per shard would weigh them wrongly). The reference: one process,
each step's micro-batches through the whole model, each micro-batch's mean loss over its targets, their mean,
clipping, the same torch optimizer.

Tolerances: the ranks add the same terms in other orders, a few fp32 ulps; losses, the pre-clip gradient norm and an
eval_step's loss on the trained weights rtol 1e-5, parameters atol 2e-5 after 3 steps (tests/test_parity.py's fp32
bounds). Measured here: losses within 1.04e-7 (relative), norms 1.49e-7, parameters 4.54e-7, eval losses equal.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerokit.pipeline
from zerokit.parallel.mesh import Layout
from zerokit.parallel.sequence import attach, next_token_losses, shard_batch, shard_position_ids
from zerokit.testing.spawn import spawn

from test_sequence_parallel import CLIP, VOCAB, llama

STAGES, SEQUENCE = 2, 2
MICRO_BATCHES, MICRO_ROWS, TOKENS, STEPS = 2, 2, 16, 3


@dataclass(frozen=True)
class Case:
    stage: int
    optimizer: str = "adamw"
    schedule: str = "1F1B"
    degree_from: str = "layout"  # or "config": Layout.resolve(world, pipeline=2) and sequence_parallel_size
    gathering: str = "step"  # stage 3: See [Note: stage 3 under a pipeline: gather once per step, or per micro-batch]

    @property
    def name(self) -> str:
        return f"s{self.stage}-{self.optimizer}-{self.schedule}-{self.degree_from}-{self.gathering}"


CASES = [Case(1), Case(2, schedule="GPipe"), Case(3), Case(1, "sgd"), Case(3, "sgd", gathering="micro_batch"),
         Case(2, "sgd", degree_from="config")]


class LlamaStage(nn.Module):
    """Stage `stage` of a LlamaForCausalLM cut by decoder layers, its parameters named as in the whole model: the
    embedding and the first layers, or the last layers, the norm and the head. Its forward takes the shard's
    input_ids (first stage) or hidden states and makes its tokens' positions from the sequence index."""

    def __init__(self, model: nn.Module, stage: int, stages: int, sequence_index: int) -> None:
        super().__init__()
        count = len(model.model.layers)
        mine = range(stage * count // stages, (stage + 1) * count // stages)
        self.first, self.last, self.sequence_index = stage == 0, stage == stages - 1, sequence_index
        self.model = nn.Module()
        if self.first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict(OrderedDict((str(i), model.model.layers[i]) for i in mine))
        self.model.rotary_emb = model.model.rotary_emb
        if self.last:
            self.model.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(tokens_or_hidden) if self.first else tokens_or_hidden
        rotary = self.model.rotary_emb(hidden, shard_position_ids(hidden, self.sequence_index))
        for layer in self.model.layers.values():
            hidden = layer(hidden, position_embeddings=rotary)
        return self.lm_head(self.model.norm(hidden)) if self.last else hidden


def optimizer_for(case: Case, params) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2)


def step_batch(step: int) -> dict[str, torch.Tensor]:
    """One step's batch (MICRO_BATCHES x MICRO_ROWS whole sequences): the prompts masked, all in the first shard."""
    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_ROWS, TOKENS), generator=generator)
    labels = input_ids.clone()
    for row in range(labels.shape[0]):
        labels[row, : 2 + step + row] = -100
    return {"input_ids": input_ids, "labels": labels}


def whole_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean over the micro-batches of each one's mean loss over its targets, the whole model on whole sequences."""
    micro = []
    for rows in torch.arange(MICRO_BATCHES * MICRO_ROWS).tensor_split(MICRO_BATCHES):
        logits = model(input_ids=batch["input_ids"][rows]).logits
        shifted = nn.functional.pad(batch["labels"][rows], (0, 1), value=-100)[:, 1:]
        micro.append(nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), shifted.reshape(-1)))
    return torch.stack(micro).mean()


def one_process(case: Case) -> dict:
    model = llama()
    optimizer = optimizer_for(case, model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        loss = whole_loss(model, step_batch(step))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        evaluated = whole_loss(model.eval(), step_batch(STEPS)).item()
    return {"losses": losses, "norms": norms, "eval": evaluated,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def config_for(case: Case) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO_ROWS, "gradient_accumulation_steps": MICRO_BATCHES,
              "zero_optimization": {"stage": case.stage}, "gradient_clipping": CLIP}
    return {**config, "sequence_parallel_size": SEQUENCE} if case.degree_from == "config" else config


def train(case: Case) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout.resolve(world, pipeline=STAGES, sequence=SEQUENCE)  # what the config route resolves too
    stage, _, _ = layout.coordinates(rank)
    stage_module = LlamaStage(llama(), stage, STAGES, layout.sequence_index(rank))
    given = Layout.resolve(world, pipeline=STAGES) if case.degree_from == "config" else layout
    pipe = zerokit.pipeline.initialize(stage_module, optimizer_for(case, stage_module.parameters()), config_for(case),
                                       given, schedule=case.schedule, loss_fn=next_token_losses,
                                       stage3_gathering=case.gathering)
    losses, norms = [], []
    for step in range(STEPS + 1):  # the last an eval step, on the trained weights
        shard = pipe.engine.sequence.shard(step_batch(step))
        inputs, target = (shard["input_ids"] if pipe.is_first_stage() else None,
                          shard["shift_labels"] if pipe.is_last_stage() else None)
        if step == STEPS:
            evaluated = pipe.eval_step(inputs, target).item()
            break
        done = pipe.train_step(inputs, target)
        losses.append(done.loss.item())
        norms.append(done.result.grad_norm)
    out = {"losses": losses, "norms": norms, "eval": evaluated, "weights": pipe.engine.full_state_dict(),
           "layout": pipe.layout, "sequence": (pipe.engine.sequence.rank, pipe.engine.sequence.ranks)}
    pipe.close()
    return out


def mean_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """A mean over this rank's tokens alone: what a pipeline without sequence ranks would take."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), shift_labels.reshape(-1))


def errors() -> dict[str, str]:
    """Bad input, each on every rank before anything trains."""
    def error(call) -> str:
        try:
            call()
        except ValueError as failure:
            return str(failure)
        return "no error"

    world, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout.resolve(world, pipeline=STAGES, sequence=SEQUENCE)
    stage, index = layout.coordinates(rank).stage, layout.sequence_index(rank)

    def pipe(loss_fn=next_token_losses, config: dict | None = None, attention: bool = True):
        module = LlamaStage(llama(), stage, STAGES, index)
        if not attention and module.last:  # the norm and the head alone on the last stage
            module.model.layers = nn.ModuleDict()
        return zerokit.pipeline.initialize(module, torch.optim.SGD(module.parameters(), lr=0.1),
                                           config or config_for(Case(1)), layout, loss_fn=loss_fn)

    mean = pipe(loss_fn=mean_loss)
    batch = step_batch(0)
    first = mean.engine.sequence.shard(batch)
    out = {"length": error(lambda: mean.engine.sequence.shard({**batch, "input_ids": batch["input_ids"][:, :-1]})),
           "mean loss": error(lambda: mean.train_step(first["input_ids"] if mean.is_first_stage() else None,
                                                      first["shift_labels"] if mean.is_last_stage() else None)),
           "no attention": error(lambda: pipe(attention=False)),
           "another degree": error(lambda: pipe(config={**config_for(Case(1)), "sequence_parallel_size": 4})),
           "deepspeed": error(deepspeed_pipeline_module)}
    mean.close()
    return out


def deepspeed_pipeline_module() -> None:
    import zerokit.deepspeed as deepspeed
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # as torchrun sets it, which DeepSpeed's initialize asks for
    from zerokit.deepspeed.pipe import PipelineModule
    model = PipelineModule(layers=[nn.Linear(4, 4), nn.Linear(4, 4)], num_stages=STAGES, loss_fn=nn.MSELoss())
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         config={"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": SEQUENCE})


def run_all(rank: int, world_size: int) -> dict:
    return {**{case.name: train(case) for case in CASES}, "errors": errors()}


@functools.lru_cache(maxsize=None)
def ranks() -> list[dict]:
    return spawn(run_all, STAGES * SEQUENCE, timeout=600)


@functools.lru_cache(maxsize=None)
def reference(case: Case) -> dict:
    return one_process(case)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_pipeline_stages_split_over_sequence_ranks_train_as_one_process(case: Case) -> None:
    expected = reference(case)
    seen = set()
    for rank, out in enumerate(ranks()):
        got = out[case.name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(expected["norms"]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"rank {rank} norms: {m}")
        assert got["eval"] == pytest.approx(expected["eval"], rel=1e-5), (rank, got["eval"], expected["eval"])
        for name, value in got["weights"].items():
            torch.testing.assert_close(value, expected["weights"][name], rtol=0, atol=2e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        seen.update(got["weights"])
    assert seen == set(expected["weights"])  # the stages together hold the whole model


@pytest.mark.parametrize("case, message", [
    ("length", "a batch of 15 tokens per sequence does not split over 2 sequence ranks: pad the sequences"),
    ("mean loss", "pipeline stage 1's loss_fn failed on the first micro-batch: with 2 sequence ranks, loss_fn must "
                  "return this rank's TokenLosses"),
    ("no attention", "pipeline stage 1: LlamaStage has no Hugging Face attention module (one with num_key_value_groups) "
                     "for sequence parallelism to split; accepted: "),
    ("another degree", "sequence_parallel_size=4 but the layout has 2 sequence rank(s)"),
    ("deepspeed", "sequence_parallel_size=2 with a DeepSpeed PipelineModule is not offered by zerokit"),
])
def test_bad_input_is_one_line_on_every_rank(case: str, message: str) -> None:
    errors = {out["errors"][case] for out in ranks()}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith(message) and "\n" not in error, error


def test_the_config_route_resolves_the_layout_with_the_pipeline_kept_and_stages_pass_along_a_sequence_index() -> None:
    """sequence_parallel_size beside Layout.resolve(4, pipeline=2) gives the layout Layout.resolve(4, pipeline=2,
    sequence=2) would: each stage's ranks are its sequence ranks, and a pipeline joins the same sequence index of
    each stage (torch's PipelineStage is given that group, so activations go to the rank holding the same tokens)."""
    expected = Layout.resolve(4, pipeline=STAGES, sequence=SEQUENCE)
    assert expected.pipeline_groups() == [[0, 2], [1, 3]] and expected.sequence_groups() == [[0, 1], [2, 3]]
    for rank, out in enumerate(ranks()):
        got = out[Case(2, "sgd", degree_from="config").name]
        assert got["layout"] == expected and got["sequence"] == (expected.sequence_index(rank), SEQUENCE)


def test_a_stage_makes_the_position_ids_the_shard_has() -> None:
    """shard_position_ids (a stage's, from the sequence index) gives each shard what engine.sequence.shard gives it."""
    batch = step_batch(0)
    for index in range(SEQUENCE):
        shard = shard_batch(batch, index, SEQUENCE)
        assert torch.equal(shard_position_ids(shard["input_ids"], index), shard["position_ids"])


def test_the_position_ids_check_sits_on_hugging_face_models_not_on_a_stage_of_ones_own() -> None:
    """See [Note: position ids where a model makes them]: a stage module of one's own is called with positional
    arguments and makes its positions itself, so it gets no check; a Hugging Face model inside a module of one's own
    does (it would number a shard from 0), as the model itself does when it is what the engine holds."""
    stage = LlamaStage(llama(), 1, STAGES, 0)
    attach(stage, None, SEQUENCE)
    assert not stage._forward_pre_hooks and not any(m._forward_pre_hooks for m in stage.modules())
    holder = nn.Module()
    holder.lm = llama()
    attach(holder, None, SEQUENCE)
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM is split over sequence ranks: pass each shard's "):
        holder.lm(input_ids=torch.zeros(1, 4, dtype=torch.long))
