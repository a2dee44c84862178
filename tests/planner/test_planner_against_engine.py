"""A plan checked against the engine itself, in one process under torch's fake 8-rank process group
(collectives return at once; the engine still counts them): the exact engine model (engine_model.py)
to the byte, after backward and after the step, and the architecture-level plan (memory.py, comms.py)
within bucket padding. The same on 2 real gloo ranks: test_planner_engine_exact.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import zerokit  # noqa: E402
from zerokit.planner import Architecture, estimate, make_scenario  # noqa: E402
from zerokit.planner.comms import KINDS  # noqa: E402
from zerokit.planner.engine_model import EngineSetup, engine_comm, engine_states  # noqa: E402
from zerokit.planner.memory import ENGINE_CATEGORIES  # noqa: E402
from zerokit.planner.models import from_architecture  # noqa: E402
from zerokit.profiling.inventory import param_inventory  # noqa: E402
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, param_groups  # noqa: E402

WORLD = 8
PARAM_GROUPS = 2  # param_groups(): decay and no-decay; the engine buckets each apart
CONFIG = TinyGPTConfig(with_test_features=False)  # a plain GPT-2 block stack, nothing frozen
# The same model in the planner's terms (GPT-2 style: LayerNorm, biases, tied embeddings, learned positions).
ARCH = Architecture(n_layers=CONFIG.n_layer, hidden=CONFIG.n_embd, n_heads=CONFIG.n_head, n_kv_heads=CONFIG.n_head,
                    ffn=4 * CONFIG.n_embd, vocab=CONFIG.vocab_size, max_positions=CONFIG.block_size,
                    tied_embeddings=True, gated_mlp=False, layernorm=True, qkv_bias=True, out_bias=True,
                    mlp_bias=True)


@pytest.fixture
def fake_world():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def one_step(stage: int, dtype: str, reduce_scatter: bool | None) -> dict:
    """A real engine's memory_stats() after backward and after the step, comm_stats() growth over a step
    (the second: the optimizer's state exists by then), and the model's parameter inventory."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    optimizer = torch.optim.AdamW(param_groups(model))
    zero = {"stage": stage, "reduce_bucket_bytes": 2**30, "reduce_scatter": reduce_scatter}
    if stage == 3:  # one unit per block, nothing kept whole for being small, as the plan below assumes
        zero.update({"stage3_unit_classes": ["Block"], "stage3_param_persistence_threshold": 0})
    engine = zerokit.initialize(model, optimizer, {"zero_optimization": zero, "bf16": {"enabled": dtype == "bf16"}})
    tokens = torch.randint(0, CONFIG.vocab_size, (1, CONFIG.block_size + 1))
    for step in range(2):
        before = engine.comm_stats()
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        after_backward = engine.memory_stats()
        engine.step()
    after = engine.comm_stats()
    grown = {kind: {key: after[kind][key] - before[kind][key] for key in after[kind]} for kind in after}
    return {"after_backward": after_backward, "after_step": engine.memory_stats(),
            "comm": {kind: entry for kind, entry in grown.items() if entry["calls"]},
            "inventory": param_inventory(model, optimizer, engine.config.stage3), "config": engine.config}


CASES = [(stage, dtype, rs) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16") for rs in (None, False)
         if not (stage == 0 and rs is False)]


@pytest.mark.parametrize("stage,dtype,reduce_scatter", CASES)
def test_engine_model_is_exact(fake_world, stage, dtype, reduce_scatter):
    run = one_step(stage, dtype, reduce_scatter)
    # the fake back-end is not gloo: the engine reduce-scatters unless told not to, as on NCCL
    setup = EngineSetup(stage=stage, world=WORLD, precision=dtype, backend="nccl", device="cpu",
                        reduce_scatter=reduce_scatter, bucket_bytes=2**30, persistence_threshold=0)
    states = engine_states(run["inventory"], setup)
    assert states.after_backward == run["after_backward"]
    assert states.after_step == run["after_step"]
    assert engine_comm(run["inventory"], setup) == run["comm"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plan_matches_the_engine(fake_world, stage):
    run = one_step(stage, "bf16", None)
    memory, comm = run["after_backward"], run["comm"]
    scenario = make_scenario(from_architecture(ARCH), gpus_per_node=WORLD, seq_len=CONFIG.block_size)
    planned = estimate(scenario.with_training(persistence_threshold=0), stage)
    assert run["inventory"].total_numel == ARCH.total_params()  # the planner counts this model's parameters exactly

    plan_memory = planned.memory.engine_dict()
    assert set(memory) == set(plan_memory) == set(ENGINE_CATEGORIES)
    buckets = comm.get("reduce_scatter", comm.get("all_reduce"))["calls"]  # one reduction per bucket
    padding = 4 * (WORLD - 1) * buckets  # at most N_d - 1 padded elements per bucket, 4 bytes at most each
    assert abs(memory["parameters"] - plan_memory["parameters"]) <= padding
    assert abs(memory["gradients"] - plan_memory["gradients"]) <= 2 * padding  # after backward: both copies
    # Adam keeps a 4-byte step count per bucket, which the plan leaves out
    extra = memory["optimizer_state"] - plan_memory["optimizer_state"]
    assert 0 <= extra <= 4 * buckets + 12 * padding

    plan_comm = planned.comm.by_kind()
    assert set(plan_comm) <= set(comm) <= set(KINDS)
    # one usage flag per trainable tensor rides on an all-reduce (the exact model above counts them)
    flags = sum(1 for e in run["inventory"].entries if e.trainable)
    for kind, measured in comm.items():
        expected = plan_comm.get(kind, {"calls": 0, "elements": 0, "bytes": 0})
        norm = kind == "all_reduce" and stage > 0  # the one-scalar gradient-norm reduction, not bucketed
        assert measured["calls"] == (1 if norm else PARAM_GROUPS) * expected["calls"], kind
        extra = flags if kind == "all_reduce" else 0
        assert 0 <= measured["elements"] - expected["elements"] <= (WORLD - 1) * measured["calls"] + extra, kind
        if not norm:
            assert measured["bytes"] * expected["elements"] == expected["bytes"] * measured["elements"], kind


def test_emitted_stage3_limits_pass_the_engines_start_up_check(fake_world):
    """The emitted stage3_max_live_parameters holds the root (with every block's small parameters) and two
    blocks, bucket padding included: the engine keeps to it as given, and reads a limit below the model's need
    (DeepSpeed's "prefetch nothing") as that need, which the emitted one covers within the padding."""
    transformers = pytest.importorskip("transformers")
    from zerokit.planner.emit import emit_zerokit
    from zerokit.planner.models import from_hf_dict

    shapes = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 384, "intermediate_size": 1024,
              "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 6}
    emitted = emit_zerokit(estimate(make_scenario(from_hf_dict(shapes), gpus_per_node=WORLD, seq_len=64), 3))
    zero = emitted["zero_optimization"]

    def start(limit: int):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**shapes))
        return zerokit.initialize(model, torch.optim.AdamW(param_groups(model)), {
            "zero_optimization": {**zero, "stage3_max_live_parameters": limit}, "bf16": {"enabled": True}}).stage.shards

    emitted_limit = zero["stage3_max_live_parameters"]
    kept = start(emitted_limit)
    assert kept.live_limit == emitted_limit and not kept.live_limit_lines()
    least = start(1)
    needed = least.needed_live_numel
    assert least.live_limit == needed and f"read as {needed:,}" in least.live_limit_lines()[0]
    assert needed <= emitted_limit <= needed + 6 * WORLD  # padding allowed: 2 x N per unit
