"""Hugging Face MoE models with their experts split over ranks by DeepSpeed's AutoEP config (`"expert_parallel":
{"enabled": true, "autoep_size": ep}`; zerokit/parallel/experts/hf.py), against the same model trained by one
process as DDP trains it: every rank's loss on its own batch (routed on its own tokens, the router's auxiliary loss
included), their mean the step's loss, clipped by the global norm.

One spawn of 4 gloo ranks runs every case: a tiny Mixtral (4 experts, top-2) and a tiny Qwen2-MoE (4 experts, top-2,
with its shared expert), split over 2 x 2 ranks (ep x expert-data) at ZeRO 1, 2 and 3 and over 4 x 1 at ZeRO 3, SGD
(Adam would hide a constant factor in the experts' gradients) and AdamW; one expert of every Mixtral layer is never
routed to (its router row pushed down), so it is idle on every rank. Tolerances as tests/test_parity.py's fp32 ones:
losses rtol 1e-5, pre-clip norms rtol 1e-4, each rank's experts after the steps atol 2e-5 against the reference's rows.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerokit
from zerokit.testing.jobs import Job, Outcomes, launch
from zerokit.testing.spawn import spawn

RANKS, ROWS, TOKENS, STEPS, VOCAB, CLIP = 4, 2, 8, 3, 61, 0.5


@dataclass(frozen=True)
class Case:
    family: str
    stage: int
    ep: int = 2
    optimizer: str = "sgd"

    @property
    def name(self) -> str:
        return f"{self.family}-z{self.stage}-ep{self.ep}-{self.optimizer}"


CASES = [Case("mixtral", stage) for stage in (1, 2, 3)] + [
    Case("mixtral", 3, optimizer="adamw"), Case("qwen2_moe", 2), Case("qwen2_moe", 3, ep=4)]


def moe_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                               num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
                               max_position_embeddings=32)
        model = MixtralForCausalLM(config)
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(_never_expert_3)
        return model
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                            shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                            output_router_logits=True, router_aux_loss_coef=0.1, max_position_embeddings=32)
    return Qwen2MoeForCausalLM(config)


def _never_expert_3(gate: torch.nn.Module, args: tuple, routed: tuple) -> tuple:
    """The router's choices of expert 3 given to expert 0 instead (to expert 1 where the token's other choice is 0):
    expert 3 is idle on every rank, with the routing weights as the router gave them."""
    logits, weights, experts = routed
    instead = torch.where(experts.flip(-1) == 0, 1, 0)  # top-2: the token's other choice is the flipped column
    return logits, weights, torch.where(experts == 3, instead, experts)


def optimizer_for(case: Case, model: torch.nn.Module) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def rank_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, TOKENS), generator=torch.Generator().manual_seed(100 * step + rank))


def one_process(case: Case) -> dict:
    """DDP's step on one process: the mean of every rank's loss, each on its own batch."""
    model = moe_model(case.family)
    optimizer = optimizer_for(case, model)
    losses, norms = [], []
    for step in range(STEPS):
        step_losses = [model(input_ids=rank_batch(step, rank), labels=rank_batch(step, rank)).loss
                       for rank in range(RANKS)]
        torch.stack(step_losses).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in step_losses])
    experts = {name: param.detach().clone() for name, param in model.named_parameters() if "experts" in name}
    return {"losses": losses, "norms": norms, "experts": experts}


def train(case: Case) -> dict:
    model = moe_model(case.family)
    engine = zerokit.initialize(model, optimizer_for(case, model),
                                {"zero_optimization": {"stage": case.stage}, "gradient_clipping": CLIP,
                                 "train_micro_batch_size_per_gpu": ROWS,
                                 "expert_parallel": {"enabled": True, "autoep_size": case.ep}})
    rank = dist.get_rank()
    losses, norms = [], []
    for step in range(STEPS):
        loss = engine(input_ids=rank_batch(step, rank), labels=rank_batch(step, rank)).loss
        engine.backward(loss)
        norms.append(engine.step().grad_norm)
        losses.append(loss.item())
    with engine.unsharded():
        experts = {f"{name}.{split.first_expert + index}.{piece}": getattr(expert, piece).detach().clone()
                   for name, split in model.named_modules() if hasattr(split, "first_expert")
                   for index, expert in enumerate(split.experts) for piece in ("gate_up_proj", "down_proj")}
    out = {"losses": losses, "norms": norms, "experts": experts, "expert_data": engine.experts.data.world_size}
    engine.close()
    return out


def run_all(rank: int, world_size: int) -> dict:
    return {case.name: train(case) for case in CASES}


@functools.lru_cache(maxsize=None)
def ranks() -> list[dict]:
    return spawn(run_all, RANKS, timeout=600)


@functools.lru_cache(maxsize=None)
def reference(case: Case) -> dict:
    return one_process(case)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_a_hugging_face_moe_with_split_experts_trains_as_ddp(case: Case) -> None:
    expected = reference(case)
    for rank, out in enumerate(ranks()):
        got = out[case.name]
        assert got["expert_data"] == RANKS // case.ep
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor([step[rank] for step in
                                                                              expected["losses"]]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(expected["norms"]), rtol=1e-4, atol=0)
        assert len(got["experts"]) == 2 * 2 * 4 // case.ep  # layers x pieces x this rank's experts
        for name, value in got["experts"].items():
            layer, index, piece = name.rsplit(".", 2)
            whole = expected["experts"][f"{layer}.{piece}"]
            torch.testing.assert_close(value, whole[int(index)], rtol=0, atol=2e-5, msg=name)


# --- through the Hugging Face Trainer and accelerate, against DDP's step -----------------------------------------
SCRIPTS = Path(__file__).parent / "scripts"
FRAMEWORK_RANKS = 2  # ep 2 x 1: the framework's path to the split, not the mesh (the spawn above covers 2 x 2, 4 x 1)
RUNS = {"trainer-zero3-ep2": ["--via", "trainer", "--stage", "3", "--ep", "2"],
        "accelerate-zero2-ep2": ["--via", "accelerate", "--stage", "2", "--ep", "2"]}


@pytest.fixture(scope="module")
def framework_runs(tmp_path_factory) -> tuple[Path, Outcomes]:
    """tests/scripts/hf_moe_ep.py on 2 ranks through `-m zerokit.deepspeed.install`, the AutoEP block in its DeepSpeed
    config. (The same script's DDP runs, plain torchrun, gave the same losses bit for bit when measured, the Trainer's
    grad norms within 2e-8: docs/moe.md; the test compares with DDP's step on one process, which costs no launch.)"""
    pytest.importorskip("accelerate")
    root = tmp_path_factory.mktemp("hf_moe_ep")
    jobs = [Job(name, [str(SCRIPTS / "hf_moe_ep.py"), *args, "--out", str(root / name)], install=True,
                preload=("transformers.trainer", "transformers.models.mixtral.modeling_mixtral"))
            for name, args in RUNS.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return root, launch(jobs, root / "jobs", ranks=FRAMEWORK_RANKS, env=env)


def outputs(root: Path, name: str) -> list[dict]:
    return [json.loads((root / name / f"rank{rank}.json").read_text()) for rank in range(FRAMEWORK_RANKS)]


@functools.lru_cache(maxsize=None)
def ddp_step_on_one_process() -> dict:
    """hf_moe_ep.py's training as DDP steps it, on one process: each step the mean of both ranks' losses (rank r
    reads batch step x 2 + r, as accelerate deals a sequential loader's batches), clipped, SGD."""
    import sys
    sys.path.insert(0, str(SCRIPTS))
    import hf_moe_ep as script
    model = script.tiny_mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=script.LR)
    rows = script.Rows(script.ROWS * script.STEPS * FRAMEWORK_RANKS).rows
    losses, norms = [], []
    for step in range(script.STEPS):
        batches = [rows[(step * FRAMEWORK_RANKS + rank) * script.ROWS:][:script.ROWS]
                   for rank in range(FRAMEWORK_RANKS)]
        step_losses = [model(input_ids=batch, labels=batch).loss for batch in batches]
        torch.stack(step_losses).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), script.CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in step_losses])
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


@pytest.mark.parametrize("framework, split", [("trainer", "zero3-ep2"), ("accelerate", "zero2-ep2")])
def test_the_frameworks_train_a_split_mixtral_as_ddp(framework_runs, framework: str, split: str) -> None:
    """The user's loop unchanged, the AutoEP block in the DeepSpeed config: every rank's losses (the Trainer logs their
    mean, with the grad norm) are DDP's step's, and the Trainer's save_model writes the model DDP's step leaves."""
    root, outcomes = framework_runs
    outcomes.check(f"{framework}-{split}")
    expected = ddp_step_on_one_process()
    for rank, ours in enumerate(outputs(root, f"{framework}-{split}")):
        assert ours["engine"] == "zerokit.deepspeed.engine" and len(ours["losses"]) == len(expected["losses"])
        want = [sum(step) / len(step) for step in expected["losses"]] if framework == "trainer" else \
            [step[rank] for step in expected["losses"]]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(want), rtol=1e-5, atol=0)
        if "norms" in ours:
            torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(expected["norms"]), rtol=1e-4, atol=0)
    if framework == "trainer":  # save_model writes the whole model, which from_pretrained loads
        from transformers import MixtralForCausalLM
        ours = MixtralForCausalLM.from_pretrained(root / f"{framework}-{split}" / "model").state_dict()
        assert list(ours) == list(expected["state"])
        for key, value in expected["state"].items():
            torch.testing.assert_close(ours[key].float(), value.float(), rtol=0, atol=2e-5, msg=key)
