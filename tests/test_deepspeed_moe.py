"""DeepSpeed's MoE layer through the drop-in (issue 45, items 3-4): tests/scripts/ds_moe.py, a DeepSpeed MoE script (two
MoE layers of 4 MLP experts, one dropless and one with a capacity, top-1 and top-2, the gate's auxiliary loss,
split_params_into_different_moe_groups_for_optimizer, SGD, clipping by the global norm at 0.05, which every step
reaches), runs on zerokit with its import lines changed, in one launch of 4 gloo ranks: with every expert on every
rank (ep_size=1) at ZeRO 3, with the experts split over 2 x 2 (ep x expert-data) ranks at ZeRO 0, 1, 2 and 3
(each MoE layer a unit of its own), and over 4 x 1 at ZeRO 2. Each trains as one process that gates each rank's
micro-batch on its own tokens and averages the ranks' losses: the same losses and the same pre-clip gradient norms.
Where DeepSpeed is installed, the unchanged script gives the same losses and norms with the experts split over 2 x 2
ranks at ZeRO 1 (top-1) and 2 (top-2) (DeepSpeed refuses its native MoE at 3; until 2026-11-29 also unsplit at ZeRO 1
and over 4 x 1 at ZeRO 2, three more runs of the launch's twelve, for what these two and one process already show).

Tolerance: the ranks add the gradients in another order than one process does (a few fp32 ulps); SGD shows a
gradient off by any factor at the next step's loss (averaging split experts over their expert-data group alone, not
the job, moved the losses by 1.5e-2). Losses rtol 1e-5, norms rtol 1e-5.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from test_deepspeed_scripts import SCRIPTS, switch_imports
from zerokit.testing.jobs import Job, Outcomes, launch

RANKS, CLIP = 4, 0.05
# (ZeRO stage, top-k, ep_size): every expert on every rank, then split over 2 x 2 and 4 x 1 ranks
ZEROKIT = [(3, 2, 1), (0, 2, 2), (1, 1, 2), (2, 2, 2), (3, 2, 2), (2, 1, 4)]
DEEPSPEED = [(1, 1, 2), (2, 2, 2)]  # the same script unchanged, at ZeRO 1-2
ACCUMULATED = (2, 2, 2)  # also with 2 micro-steps to each optimizer step
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def name_of(engine: str, stage: int, k: int, ep: int) -> str:
    return f"{engine}-{stage}-k{k}-ep{ep}"


@functools.lru_cache(maxsize=None)
def runs(root: Path) -> tuple[Path, Outcomes]:
    switched = root / "ds_moe.py"
    switched.write_text(switch_imports((SCRIPTS / "ds_moe.py").read_text()))

    def job(engine: str, script: Path, stage: int, k: int, ep: int, preload: str, accumulation: int = 1) -> Job:
        name = name_of(engine, stage, k, ep) + (f"-accum{accumulation}" if accumulation > 1 else "")
        units = ["--units"] if stage == 3 else []  # each MoE layer a unit: gathered and freed around split experts
        return Job(name, [str(script), "--stage", str(stage), "--k", str(k), "--ep-size", str(ep), "--clip", str(CLIP),
                          "--accumulation", str(accumulation), *units, "--out", str(root / name)], preload=(preload,))
    jobs = [job("zerokit", switched, *case, "zerokit.deepspeed") for case in ZEROKIT]
    jobs.append(job("zerokit", switched, *ACCUMULATED, "zerokit.deepspeed", accumulation=2))
    if HAS_DEEPSPEED:
        jobs += [job("deepspeed", SCRIPTS / "ds_moe.py", *case, "zerokit.testing.deepspeed_peer") for case in DEEPSPEED]
    return root, launch(jobs, root / "jobs", ranks=RANKS)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Outcomes]:
    return runs(tmp_path_factory.mktemp("ds_moe"))


def results_of(launched: tuple[Path, Outcomes], name: str) -> list[dict]:
    root, outcomes = launched
    outcomes.check(name)
    return [json.loads((root / name / f"rank{rank}.json").read_text()) for rank in range(RANKS)]


@functools.lru_cache(maxsize=None)
def script_namespace() -> dict:
    """tests/scripts/ds_moe.py's names, its imports switched to zerokit's."""
    sys.path.insert(0, str(SCRIPTS))
    source = switch_imports((SCRIPTS / "ds_moe.py").read_text())
    namespace: dict = {"__name__": "ds_moe_reference"}
    exec(compile(source, "ds_moe.py", "exec"), namespace)
    return namespace


def one_process_model() -> nn.Module:
    """The script's model with every expert (ep_size=1), top-2."""
    return script_namespace()["MoEModel"](2, 1)


@functools.lru_cache(maxsize=None)
def one_process(k: int, accumulation: int = 1) -> tuple[list[list[float]], list[float]]:
    """The script's model in one process, holding every expert (zerokit's MoE is the same module DeepSpeed's is,
    checked in tests/test_expert_dispatch.py): each micro-step, each rank's micro-batch through the model on its own,
    drawing the gate's random numbers from that rank's generator, the mean of the ranks' losses over the window's
    micro-steps, clipping at CLIP, SGD. Returns each rank's losses and each optimizer step's pre-clip norm. Experts
    split over ranks start alike: each is a copy of one module, as DeepSpeed makes them."""
    namespace = script_namespace()
    torch.manual_seed(0)
    model = namespace["MoEModel"](k, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    per_rank: list[list[float]] = [[] for _ in range(RANKS)]
    norms = []
    generators = [torch.get_rng_state()] * RANKS  # each rank's default generator, as its process draws from it
    for step in range(namespace["STEPS"]):
        losses = []
        for rank in range(RANKS):
            tokens = namespace["batch"](rank, step)
            torch.set_rng_state(generators[rank])  # the gate's random token selection and second-expert sampling
            logits, aux = model(tokens[:, :-1])
            generators[rank] = torch.get_rng_state()
            losses.append(nn.functional.cross_entropy(logits.reshape(-1, namespace["VOCAB"]),
                                                      tokens[:, 1:].reshape(-1)) + namespace["AUX"] * aux)
            per_rank[rank].append(losses[-1].item())
        (torch.stack(losses).mean() / accumulation).backward()
        if (step + 1) % accumulation == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            optimizer.step()
            optimizer.zero_grad()
    return per_rank, norms


@pytest.mark.parametrize("stage,k,ep", ZEROKIT, ids=[name_of("zerokit", *case) for case in ZEROKIT])
def test_a_deepspeed_moe_script_trains_on_zerokit_as_one_process(launched, stage: int, k: int, ep: int) -> None:
    assert_as_one_process(results_of(launched, name_of("zerokit", stage, k, ep)), k, accumulation=1)


def assert_as_one_process(got: list[dict], k: int, accumulation: int) -> None:
    losses, norms = one_process(k, accumulation)
    assert len(norms) == 4 // accumulation and min(norms) > CLIP  # every step clips: a wrong norm shows in the losses
    torch.testing.assert_close(torch.tensor([each["losses"] for each in got]), torch.tensor(losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor([each["norms"] for each in got]), torch.tensor([norms] * RANKS),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("ep", (2, 4))
def test_the_script_finds_its_expert_groups_where_deepspeed_puts_them(launched, ep: int) -> None:
    """deepspeed.utils.groups' expert getters, in DeepSpeed's order: expert groups of consecutive ranks, expert-data
    groups strided across them (ep size, ep rank, expert-data size, expert-data rank, the expert group's first rank)."""
    stage, k, _ = next(case for case in ZEROKIT if case[2] == ep)
    got = [each["expert_groups"] for each in results_of(launched, name_of("zerokit", stage, k, ep))]
    assert got == [[ep, rank % ep, RANKS // ep, rank // ep, rank - rank % ep] for rank in range(RANKS)]


def test_zero3_shards_split_experts_over_their_expert_data_group(launched) -> None:
    """Counted bytes: at ZeRO 2 a rank holds the dense parameters and its 2 experts of each layer whole; at ZeRO 3 its
    quarter of the dense ones (sharded over the 4 ranks) and half of its experts (over their expert-data group of 2).
    SGD without momentum has no state, and fp32 trains the parameters themselves."""
    model = one_process_model()
    local_experts = sum(p.numel() for name, p in model.named_parameters() if ".deepspeed_experts." in name) // 2
    stage2, stage3 = ([each["memory"] for each in results_of(launched, name_of("zerokit", stage, 2, 2))]
                      for stage in (2, 3))
    for held2, held3 in zip(stage2, stage3):
        dense = held2["parameters"] - 4 * local_experts
        assert held3 == {"parameters": dense // RANKS + 4 * local_experts // 2, "gradients": 0, "optimizer_state": 0}


def test_split_experts_accumulate_as_one_process(launched) -> None:
    assert_as_one_process(results_of(launched, name_of("zerokit", *ACCUMULATED) + "-accum2"), ACCUMULATED[1],
                          accumulation=2)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed to compare with")
@pytest.mark.parametrize("stage,k,ep", DEEPSPEED, ids=[name_of("deepspeed", *case) for case in DEEPSPEED])
def test_real_deepspeed_trains_the_unchanged_script_alike(launched, stage: int, k: int, ep: int) -> None:
    ours, theirs = (results_of(launched, name_of(engine, stage, k, ep)) for engine in ("zerokit", "deepspeed"))
    assert [each["expert_groups"] for each in ours] == [each["expert_groups"] for each in theirs]
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor([each[key] for each in ours]),
                                   torch.tensor([each[key] for each in theirs]), rtol=1e-5, atol=0)


def test_the_optimizer_groups_split_as_deepspeeds() -> None:
    """Expert parameters move to a group of their own, named by the expert group and marked moe, with the group's
    settings; the dense ones stay."""
    from zerokit.deepspeed.moe.layer import MoE
    from zerokit.deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    layer = nn.ModuleDict({"dense": nn.Linear(4, 4), "moe": MoE(4, nn.Linear(4, 4), num_experts=2)})
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(layer.parameters()), "lr": 0.1,
                                                                   "name": "parameters"})
    assert [group["name"] for group in groups] == ["parameters", "ep_size_1"]
    assert groups[1]["moe"] and groups[1]["lr"] == 0.1 and all(is_moe_param(p) for p in groups[1]["params"])
    assert len(groups[1]["params"]) == 4 and not any(is_moe_param(p) for p in groups[0]["params"])
