"""Tensor parallelism inside a node, ZeRO across the replicas (zerokit/parallel/tensor): a Hugging Face Llama split by its
tp_plan over 2 tensor ranks x 2 data replicas equals one process on the union of the replicas' batches at ZeRO 1-3
(parity.run_reference with 2 ranks); DeepSpeed's AutoTP + ZeRO-2 run of the same script and config equals the
drop-in's; torch's own tensor parallelism trains the same; the LLaMA-Factory AutoTP config trains; a checkpoint
resumes exactly; a degree or a plan that does not fit is refused in one line on every rank.

Tolerances, and why (measured on this machine):
- fp32: the split layers add each output's partial sums in two pieces (one matmul per tensor rank, then the all-
  reduce), the reference in one matmul, so activations differ by fp32 ulps; Adam's division by sqrt(v) enlarges that
  on near-zero gradients. Measured: losses within 1.2e-7 relative, gradient norms within 2.5e-8 relative, parameters
  within 5e-6. Allowed: losses and norms rtol 1e-5, parameters atol 2e-5, as tests/test_parity.py allows (under 1%
  of one 3e-3 Adam step, so a wrong piece, a replicated parameter counted twice in the norm or a lost reduction
  cannot hide in it: counting the replicated parameters twice changes the first norm by 20%). The LLaMA-Factory run
  clips at 1.0, which barely clips (norms 1.08), so its Adam steps are whole: its parameters ended within 5e-5 (an
  element with a near-zero gradient: 1.7% of one step); allowed 1e-4 there.
- 16-bit: the split sums round to bf16/fp16 at other points than one process's, and the run drifts from there.
  Measured by the error of the whole update |p - p_ref| / |p_ref - p_init| (See tests/test_parity.py): bf16 5.4e-2,
  where one process in bf16 lands 7.2e-2 from one process in fp32; allowed: below that, bf16's own error. fp16
  (two overflowing steps, then two): 9.6e-3; allowed 5e-2, test_parity's 16-bit bound. Losses: rtol 5e-4 (measured
  6.3e-5).
- DeepSpeed 0.19.8 vs the drop-in, fp32 ZeRO-2 with clipping and accumulation: losses and norms measured equal to
  1e-7 relative; allowed rtol 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zerokit.parallel.mesh import Layout
from zerokit.testing.parity import Case, run_reference
from zerokit.testing.spawn import spawn
from zerokit.testing.tensor_parity import AUTOTP_CASE, deepspeed_config, run_relayout, run_resume, run_tensor_cases

TENSOR, WORLD = 2, 4
LLAMA = "hf-llama-untied"
FIXTURES = Path(__file__).parent / "fixtures" / "ds_configs"
SCRIPTS = Path(__file__).parent / "scripts"

# The LLaMA-Factory config with its "auto" values as the Hugging Face Trainer fills them for 4 ranks (micro-batch 2,
# no accumulation): train_batch_size 8 counts the tensor ranks as DeepSpeed does.
LLAMA_FACTORY = json.loads((FIXTURES / "public" / "llama_factory_ds_z2_autotp_config.json").read_text())
LLAMA_FACTORY_FILLED = {**{k: v for k, v in LLAMA_FACTORY.items() if not k.startswith("_")},
                        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "gradient_clipping": 1.0, "fp16": {**LLAMA_FACTORY["fp16"], "enabled": False},
                        "bf16": {"enabled": False}}

RUNS = [  # (case, route, config): route "deepspeed" is the Hugging Face Trainer's path through the drop-in
    (Case("stage1-fp32", 1, model=LLAMA, steps=3, clip=0.05), "zerokit", None),
    (AUTOTP_CASE, "deepspeed", None),  # stage 2, accumulation 2: also what tests/scripts/ds_autotp.py trains
    (Case("stage3-fp32", 3, model=LLAMA, steps=3, clip=0.05), "zerokit", None),
    (Case("stage1-bf16", 1, model=LLAMA, dtype="bf16", steps=2, clip=0.05), "zerokit", None),
    (Case("stage3-bf16", 3, model=LLAMA, dtype="bf16", steps=2, clip=0.05), "zerokit", None),
    # an fp16 scale of 2^20 overflows the first two steps' gradients (in one process too): every rank must skip them
    (Case("stage2-fp16-overflow", 2, model=LLAMA, dtype="fp16", steps=4, clip=0.05, initial_scale_power=20),
     "zerokit", None),
    (Case("llama-factory", 2, model=LLAMA, steps=2, clip=1.0), "deepspeed", LLAMA_FACTORY_FILLED),
    # torch's own tensor parallelism (parallelize_module on the layout's tensor mesh), handed to zerokit.initialize
    (Case("torch-tp-stage1", 1, model=LLAMA, steps=3, clip=0.05), "torch", None),
    (Case("torch-tp-stage3", 3, model=LLAMA, steps=3, clip=0.05), "torch", None),
    # Hugging Face's own: from_pretrained(tp_plan="auto", device_mesh=...) on the layout's tensor mesh
    (Case("hf-tp-plan-stage2", 2, model=LLAMA, steps=3, clip=0.05), "hf", None),
]
CASES = {case.name: case for case, _, _ in RUNS}
RESUME = Case("resume", 2, model="hf-llama-mha", steps=3, clip=0.05, accumulation=2)  # 4 heads: a degree of 4 fits
BOUNDS = {"fp16": 5e-2}  # update error (bf16: its own error against fp32); losses rtol 5e-4

BAD = [  # (what, config given to initialize, model sizes or a torch plan) -> the one line every rank must raise
    ("degree of the ranks", {"tensor_parallel": {"autotp_size": 3}}, {},
     "4 ranks do not split into 1 pipeline stage(s) x 3 tensor rank(s)"),
    ("degree of a node", {"tensor_parallel": {"autotp_size": 4}, "ranks_per_node": 2}, {},
     "a tensor degree of 4 does not divide the 2 ranks of a node"),
    ("degree of the heads", {"tensor_parallel": {"autotp_size": 4}}, {},
     "a tensor degree of 4 does not divide the model's 2 num_key_value_heads (accepted: 1, 2)"),
    ("degree of a layer", {"tensor_parallel": {"autotp_size": 2}}, {"intermediate_size": 63},
     "a tensor degree of 2 does not divide the 63 outputs of model.layers.0.mlp.gate_proj, which the plan splits "
     "column-wise (accepted: 1, 3, 7, 9, 21, 63)"),
    ("a layout with nothing split", {}, {"plan": "none"},
     "the layout has 2 tensor ranks but the model has no split layers"),
    ("sequence-parallel layout", {}, {"plan": "sequence"},
     "model.layers.0.mlp.up_proj: a DTensor linear with weight placements Shard(dim=0) and layouts"),
    # an embedding split by vocabulary is held whole (See [Note: an embedding the plan splits is held whole]): with
    # nothing else split, the layout splits nothing
    ("a vocabulary-split embedding alone", {}, {"plan": "embedding"},
     "the layout has 2 tensor ranks but the model has no split layers"),
    ("an embedding tied to a split head", {}, {"plan": "tied"},
     "lm_head and model.embed_tokens share a parameter (tied weights) that the plan splits"),
]


def run_all(rank: int, world_size: int) -> dict:
    bad = [refusal(config, sizes) for _, config, sizes, _ in BAD]
    resume = run_resume(rank, world_size, RESUME, TENSOR)
    relayout = {middle: run_relayout(rank, world_size, RESUME, TENSOR, middle) for middle in ("flat", "all-tensor")}
    return {**run_tensor_cases(rank, world_size, RUNS, TENSOR), "bad": bad, "resume": resume, "relayout": relayout}


def refusal(config: dict, sizes: dict) -> tuple[str, bool]:
    """What initialize raises on this rank for `config` and a Llama of these sizes (or parallelized by a torch plan),
    and whether the model is untouched (nothing split, nothing trained)."""
    sizes = dict(sizes)
    import transformers

    import zerokit
    torch.manual_seed(0)
    plan = sizes.pop("plan", None)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        "vocab_size": 68, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16, **sizes}))
    layout = None
    if plan is not None:  # torch's route: parallelized by the user, a layout passed
        layout = Layout.resolve(WORLD, tensor=TENSOR)
        torch_plan(model, layout.device_mesh("cpu")["tensor"], plan)
    before = {name: p.detach().clone() for name, p in model.named_parameters()} if plan is None else {}
    try:
        zerokit.initialize(model, torch.optim.AdamW(model.parameters()), config, layout=layout)
    except ValueError as error:
        after = dict(model.named_parameters())
        untouched = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
        return str(error), untouched
    return "", False


def torch_plan(model, mesh, plan: str) -> None:
    """A plan zerokit refuses: "none": nothing split; "sequence": an MLP input projection whose output is sharded
    on the sequence dimension; "embedding": a vocabulary-split embedding (torchtitan's) and nothing else; "tied": the
    embedding tied to a column-split head's weight."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    if plan == "none":
        return
    if plan == "sequence":
        parallelize_module(model, mesh, {"model.layers.0.mlp.up_proj": ColwiseParallel(output_layouts=Shard(1))})
    elif plan == "tied":  # the head split column-wise, then the embedding tied to its DTensor weight
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
        model.model.embed_tokens.weight = model.lm_head.weight
    else:
        parallelize_module(model, mesh, {"model.embed_tokens": RowwiseParallel()})


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(run_all, WORLD, timeout=900)


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {name: run_reference(case, WORLD // TENSOR) for name, case in CASES.items()}


def replica_losses(reference: dict, replica: int) -> list[float]:
    return [loss for _, rank, loss in reference["losses"] if rank == replica]


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.dtype == "fp32"])
def test_fp32_equals_one_process(ranks, references, name) -> None:
    reference = references[name]
    for out in ranks:
        got = out[name]
        torch.testing.assert_close(torch.tensor([loss for *_, loss in got["losses"]]),
                                   torch.tensor(replica_losses(reference, got["replica"])), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in got["results"]], dtype=torch.float64),
                                   torch.tensor(reference["norms"], dtype=torch.float64), rtol=1e-5, atol=0)
        assert all(r["clipped"] for r in got["results"]) or name == "llama-factory"
        assert got["params"].keys() == reference["params"].keys()
        atol = 1e-4 if name == "llama-factory" else 2e-5  # See the module's docstring
        for param, value in got["params"].items():  # consolidated: whole tensors on every rank
            torch.testing.assert_close(value, reference["params"][param], rtol=0, atol=atol,
                                       msg=lambda m: f"{param}: {m}")


def test_the_consolidated_state_loads_into_the_model_without_tensor_parallelism(ranks, references) -> None:
    """engine.full_state_dict() gathers every split parameter's pieces across the tensor group: the whole model,
    loadable as it is into a model built without tensor parallelism, on every rank alike."""
    from zerokit.testing.parity import forward_loss, make_batch, make_model
    case = CASES["stage3-fp32"]
    state = ranks[0][case.name]["params"]
    model = make_model(case)
    model.load_state_dict(state, strict=True)
    assert all(torch.equal(out[case.name]["params"][name], state[name]) for out in ranks for name in state)
    reference = make_model(case)
    reference.load_state_dict(references[case.name]["params"])
    with torch.no_grad():
        batch = make_batch(case, step=99, micro=0, rank=0)
        torch.testing.assert_close(forward_loss(model, batch), forward_loss(reference, batch), rtol=1e-5, atol=0)


def test_the_plan_splits_attention_mlp_and_head_and_replicates_the_rest(ranks) -> None:
    split = ranks[0]["stage1-fp32"]["split"]
    for layer in range(2):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert split[f"model.layers.{layer}.{name}.weight"] == 0
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert split[f"model.layers.{layer}.{name}.weight"] == 1
    assert split["lm_head.weight"] == 0 and len(split) == 15  # the embedding and the norms stay whole
    # Hugging Face's tp_plan="auto" splits the same 15 (its vocabulary-split embedding is held whole)
    assert ranks[0]["hf-tp-plan-stage2"]["split"] == split
    for out in ranks:  # the engine shards over the 2 replicas of its tensor rank; DeepSpeed's batch arithmetic
        assert out["stage1-fp32"]["data_ranks"] == 2
        assert (out["ds-autotp"]["accumulation"], out["ds-autotp"]["train_batch_size"]) == (2, 16)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.dtype != "fp32"])
def test_16_bit_follows_one_process(ranks, references, name) -> None:
    reference, case = references[name], CASES[name]
    initial = initial_params(case)
    bound = BOUNDS[case.dtype] if case.dtype == "fp16" else bf16_own_error(case, reference, initial)
    for out in ranks:
        got = out[name]
        assert [r["skipped"] for r in got["results"]] == reference["skipped"]  # overflow agreed on every rank
        torch.testing.assert_close(torch.tensor([loss for *_, loss in got["losses"]]),
                                   torch.tensor(replica_losses(reference, got["replica"])), rtol=5e-4, atol=0)
        error = update_error(got["params"], reference["params"], initial)
        assert error < bound, (error, bound)
    if name.endswith("overflow"):
        assert reference["skipped"][:2] == [True, True] and not any(reference["skipped"][2:])


def bf16_own_error(case: Case, reference: dict, initial: dict) -> float:
    """How far one process in bf16 lands from one process in fp32 (the update error): the error bf16 itself makes,
    which the tensor split's other rounding points must stay below."""
    fp32 = run_reference(replace(case, dtype="fp32"), WORLD // TENSOR)
    return update_error(reference["params"], fp32["params"], initial)


def initial_params(case: Case) -> dict[str, torch.Tensor]:
    from zerokit.testing.parity import fp32_state, make_model
    return fp32_state(make_model(case))


def update_error(got: dict, expected: dict, initial: dict) -> float:
    """|p - p_ref| / |p_ref - p_init| over every element of every parameter (See tests/test_parity.py)."""
    error = sum((got[n].float() - expected[n]).norm() ** 2 for n in expected) ** 0.5
    update = sum((expected[n] - initial[n]).norm() ** 2 for n in expected) ** 0.5
    return float(error / update)


@pytest.mark.parametrize("index", range(len(BAD)), ids=[what for what, *_ in BAD])
def test_a_degree_that_does_not_fit_is_refused_in_one_line_on_every_rank(ranks, index) -> None:
    *_, expected = BAD[index]
    for out in ranks:
        message, untouched = out["bad"][index]
        assert message.startswith(expected) and "\n" not in message, message
        assert untouched or not BAD[index][1]  # torch's route: the model came split already


def test_a_checkpoint_resumes_exactly(ranks) -> None:
    """Saved after 2 of 3 steps (each tensor rank's engine into a directory of its own), loaded by a fresh engine on a
    fresh model: the third step's loss and every parameter equal the uninterrupted run's, bit for bit."""
    for out in ranks:
        uninterrupted, resumed = out["resume"]["uninterrupted"], out["resume"]["resumed"]
        assert uninterrupted["files"] == ["tensor0-of-2", "tensor1-of-2"]
        assert resumed["loss"] == uninterrupted["loss"]
        assert all(torch.equal(resumed["params"][n], value) for n, value in uninterrupted["params"].items())


@pytest.mark.parametrize("middle", ["flat", "all-tensor"])
def test_a_checkpoint_moves_to_another_tensor_degree_and_back(ranks, middle) -> None:
    """Tensor 2 x data 2 at ZeRO-2 saves after the first step; the second step runs on flat ZeRO-3 over the 4 ranks, or
    on one tensor group of all 4 ranks (a degree of 4) at ZeRO-2, loaded from it (each piece concatenated with its
    tensor sibling's, then cut as that layout holds it), on the same micro-batches, and saves; tensor 2 x data 2 loads
    that and takes the third: the last loss and every parameter equal the uninterrupted run's to fp32's tolerance of
    this file (the other layout adds in another order; measured: the loss equal, parameters within 4.1e-8 through
    flat ZeRO-3 and 1.2e-7 through a degree of 4), Adam's moments included (loaded without them, through flat
    ZeRO-3: the loss 1.6e-5 relative away, parameters 1.0e-2, 500 times this file's tolerance)."""
    for out in ranks:
        uninterrupted, relaid = out["resume"]["uninterrupted"], out["relayout"][middle]
        assert relaid["tensor_parts"] == ["tensor0-of-2", "tensor1-of-2"]
        assert relaid["middle_parts"] == (["global_step2", "latest"] if middle == "flat"
                                          else [f"tensor{j}-of-4" for j in range(4)])
        assert relaid["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-5)
        for name, value in uninterrupted["params"].items():
            torch.testing.assert_close(relaid["params"][name], value, rtol=0, atol=2e-5)
    assert ranks[0]["relayout"][middle]["consolidated"] is True  # `zerokit consolidate` of the parts: what it loaded


def test_the_llama_factory_autotp_config_trains(ranks) -> None:
    """Through the drop-in as the Hugging Face Trainer calls it (tp_model_init, then initialize), with the values it
    fills for "auto"; test_fp32_equals_one_process holds its losses to one process's."""
    assert all(len(out["llama-factory"]["losses"]) == 2 for out in ranks)
    assert all(out["llama-factory"]["accumulation"] == 1 for out in ranks)


HAS_DEEPSPEED = __import__("importlib").util.find_spec("deepspeed") is not None


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (the bench extra)")
def test_deepspeed_autotp_zero2_trains_the_same_as_the_drop_in(ranks, tmp_path) -> None:
    """tests/scripts/ds_autotp.py under DeepSpeed 0.19.8 itself (4 CPU ranks under torchrun, a process of its own:
    DeepSpeed patches torch), against the drop-in's run of the same loop and config in the spawn. The script runs
    unchanged through zerokit.testing.deepspeed_peer: no shared-memory op built, so AutoTP's inference_all_reduce is
    torch.distributed.all_reduce (See [Note: DeepSpeed's shared-memory all-reduce, not built for a peer])."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(deepspeed_config(AUTOTP_CASE, TENSOR)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(Path(__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
               "-m", "zerokit.testing.deepspeed_peer", str(SCRIPTS / "ds_autotp.py"), str(config),
               str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for rank, ours in enumerate(ranks):
        theirs = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        got = ours[AUTOTP_CASE.name]
        assert (theirs["accumulation"], theirs["train_batch_size"]) == (got["accumulation"], got["train_batch_size"])
        assert theirs["replica"] == got["replica"]
        assert [loss for *_, loss in got["losses"]] == pytest.approx(theirs["losses"], rel=1e-6)
        assert [r["grad_norm"] for r in got["results"]] == pytest.approx(theirs["norms"], rel=1e-6)
