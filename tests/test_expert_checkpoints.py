"""Checkpoints of models whose experts are split over ranks (issue 45, item 6; See [Note: split experts saved as the
unsplit model's parameters] in zerokit/parallel/experts/names.py): saved at one expert degree and ZeRO stage, a
checkpoint resumes at another (1 included: the experts then held whole by every rank) and another stage, and the run
goes on as the one that saved it went on; it consolidates to the Hugging Face model's own keys.

One spawn of 4 gloo ranks: a tiny Mixtral (4 experts, top-2, the router's auxiliary loss, one expert idle) trains 2 steps with AdamW
(its moments and step count must come back, or the next steps differ), saves, and trains 2 more: those 2 losses are
what every resumed run must repeat (rtol 1e-6: the same arithmetic up to the order of a few sums).
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerokit
from test_hf_experts import VOCAB, moe_model
from zerokit.testing.spawn import spawn

RANKS, ROWS, TOKENS = 4, 2, 8
SAVED_BY = (2, 2)  # expert degree, ZeRO stage
RESUMED_BY = [(2, 3), (4, 1), (1, 2), (2, 0)]


def mixtral() -> torch.nn.Module:
    return moe_model("mixtral")  # tests/test_hf_experts.py's tiny Mixtral: 4 experts, top-2, expert 3 idle


class MoENet(torch.nn.Module):
    """DeepSpeed's MoE layer (ExpertParallelMoE, what deepspeed.moe.layer.MoE is on zerokit) between two linears: its
    experts are saved per expert, under their global index."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        from zerokit.parallel.experts.layer import ExpertParallelMoE
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        self.moe = ExpertParallelMoE(8, expert, num_experts=4, ep_size=ep, k=2, drop_tokens=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, aux, _ = self.moe(self.inp(x))
        return self.out(hidden).pow(2).mean() + 0.01 * aux


def engine_at(ep: int, stage: int, kind: str = "mixtral") -> zerokit.Engine:
    """kind: "mixtral", "moe" (MoENet) or "drop-in" (MoENet through zerokit.deepspeed.initialize)."""
    model = mixtral() if kind == "mixtral" else MoENet(ep)
    experts = {"expert_parallel": {"enabled": True, "autoep_size": ep}} if ep > 1 and kind == "mixtral" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"zero_optimization": {"stage": stage}, "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": ROWS,
              **experts}
    if kind == "drop-in":
        import zerokit.deepspeed as deepspeed
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # torchrun's, which DeepSpeed's initialize asks for
        return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    return zerokit.initialize(model, optimizer, config)


def steps(engine: zerokit.Engine, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
        if isinstance(engine.module, MoENet):
            loss = engine(torch.randn(ROWS * TOKENS, 8, generator=generator))
        else:
            tokens = torch.randint(0, VOCAB, (ROWS, TOKENS), generator=generator)
            loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deepspeed_moe(directory: str) -> dict:
    """The same at DeepSpeed's MoE layer: saved at ep 2 and ZeRO-1, resumed at ep 4 and ZeRO-3 (by the drop-in's
    deepspeed.initialize and load_checkpoint), and at ep 1."""
    saved = engine_at(2, 1, "moe")
    steps(saved, 0, 2)
    saved.save_checkpoint(directory, tag="moe")
    out = {"moe went_on": steps(saved, 2, 2)}
    saved.close()
    for ep, stage in ((4, 3), (1, 2)):
        engine = engine_at(ep, stage, "drop-in" if ep == 4 else "moe")  # DeepSpeed's engine loads it too
        engine.load_checkpoint(directory, tag="moe")
        out[f"moe ep{ep}-z{stage}"] = steps(engine, 2, 2)
        engine.close()
    return out


def whole_weights(directory: str) -> dict:
    """The whole model's weights out of a split engine: full_state_dict() on every rank, save_pretrained's files, and
    those files loaded by load_pretrained into an engine split otherwise."""
    split = engine_at(2, 3)
    steps(split, 0, 2)
    out = {"full": split.full_state_dict()}
    split.save_pretrained(Path(directory) / "pretrained")
    split.close()
    other = engine_at(4, 1)
    other.load_pretrained(Path(directory) / "pretrained")
    out["loaded"] = other.full_state_dict()
    other.close()
    return out


def run_all(rank: int, world_size: int, directory: str) -> dict:
    saved = engine_at(*SAVED_BY)
    steps(saved, 0, 2)
    saved.save_checkpoint(directory, tag="two")
    out = {"went_on": steps(saved, 2, 2), **whole_weights(directory)}
    saved.close()
    for ep, stage in RESUMED_BY:
        engine = engine_at(ep, stage)
        engine.load_checkpoint(directory, tag="two")
        out[f"ep{ep}-z{stage}"] = steps(engine, 2, 2)
        engine.close()
    whole = engine_at(1, 1)  # the same run without expert parallelism saves the unsplit model's checkpoint
    steps(whole, 0, 2)
    out["unsplit full"] = whole.full_state_dict()
    whole.save_checkpoint(directory, tag="unsplit")
    out["unsplit went_on"] = steps(whole, 2, 2)
    whole.close()
    split = engine_at(4, 2)
    split.load_checkpoint(directory, tag="unsplit")
    out["unsplit into ep4-z2"] = steps(split, 2, 2)
    split.close()
    return {**out, **deepspeed_moe(directory)}


@functools.lru_cache(maxsize=None)
def ranks() -> tuple[list[dict], dict, dict]:
    from safetensors.torch import load_file
    from zerokit.checkpoint.consolidate import consolidate
    with tempfile.TemporaryDirectory() as directory:
        results = spawn(run_all, RANKS, directory, timeout=600)
        consolidate(directory, Path(directory) / "split.safetensors", tag="two")
        consolidate(directory, Path(directory) / "unsplit.safetensors", tag="unsplit")
        from transformers import MixtralForCausalLM
        results[0]["from_pretrained"] = MixtralForCausalLM.from_pretrained(Path(directory) / "pretrained").state_dict()
        return results, load_file(Path(directory) / "split.safetensors"), load_file(Path(directory) /
                                                                                    "unsplit.safetensors")


@pytest.mark.parametrize("ep, stage", RESUMED_BY)
def test_a_checkpoint_of_split_experts_resumes_at_another_degree_and_stage(ep: int, stage: int) -> None:
    results, _, _ = ranks()
    for out in results:
        torch.testing.assert_close(torch.tensor(out[f"ep{ep}-z{stage}"]), torch.tensor(out["went_on"]), rtol=1e-6,
                                   atol=0)


def test_an_unsplit_checkpoint_resumes_with_the_experts_split() -> None:
    results, _, _ = ranks()
    for out in results:
        torch.testing.assert_close(torch.tensor(out["unsplit into ep4-z2"]), torch.tensor(out["unsplit went_on"]),
                                   rtol=1e-6, atol=0)


def test_a_split_checkpoint_consolidates_to_the_hugging_face_models_keys() -> None:
    _, split, unsplit = ranks()
    keys = [key for key in mixtral().state_dict() if not key.endswith("inv_freq")]
    assert sorted(split) == sorted(keys) == sorted(unsplit)
    assert split["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 48, 16)
    for key in keys:  # the same 2 AdamW steps, split over 2 x 2 ranks at ZeRO-2 and whole at ZeRO-1 (measured: 2.5e-6)
        torch.testing.assert_close(split[key], unsplit[key], rtol=0, atol=2e-5, msg=key)  # test_parity.py's bound


@pytest.mark.parametrize("ep, stage", [(4, 3), (1, 2)])
def test_deepspeeds_moe_layer_resumes_at_another_degree_and_stage(ep: int, stage: int) -> None:
    results, _, _ = ranks()
    for out in results:
        torch.testing.assert_close(torch.tensor(out[f"moe ep{ep}-z{stage}"]), torch.tensor(out["moe went_on"]),
                                   rtol=1e-6, atol=0)


def test_a_split_models_whole_weights_are_the_hugging_face_models() -> None:
    """full_state_dict() on every rank, save_pretrained's files (read back by transformers' from_pretrained) and
    load_pretrained into another split: each the unsplit run's weights (ZeRO-3 at ep 2 against ZeRO-1 whole)."""
    results, _, _ = ranks()
    unsplit = results[0]["unsplit full"]
    for out in results:
        assert list(out["full"]) == list(unsplit) == list(out["loaded"])
        for key, value in unsplit.items():
            torch.testing.assert_close(out["full"][key], value, rtol=0, atol=2e-5, msg=key)
            torch.testing.assert_close(out["loaded"][key], out["full"][key], rtol=0, atol=0, msg=key)
    written = results[0]["from_pretrained"]
    for key, value in results[0]["full"].items():
        torch.testing.assert_close(written[key].float(), value, rtol=0, atol=0, msg=key)
