"""A plan checked against a run: the engine's own `memory_stats()` and `comm_stats()` for a small GPT,
in one process under torch's fake 8-rank process group (collectives return at once; the engine still
counts them), next to the planner's estimate for the same shapes. Categories, kinds and units must
be the same; the numbers agree up to the differences docs/planner.md lists."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import zerokit  # noqa: E402
from zerokit.planner import Architecture, estimate, make_scenario  # noqa: E402
from zerokit.planner.comms import KINDS  # noqa: E402
from zerokit.planner.memory import ENGINE_CATEGORIES  # noqa: E402
from zerokit.planner.models import from_architecture  # noqa: E402
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


def one_step(stage: int) -> tuple[dict, dict, int]:
    """(memory_stats, comm_stats growth over one optimizer step, parameter count) of a real engine."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = {"stage": stage, "reduce_bucket_bytes": 2**30}
    if stage == 3:  # one unit per block, nothing kept whole for being small, as the plan assumes
        zero.update({"stage3_unit_classes": ["Block"], "stage3_param_persistence_threshold": 0})
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model)),
                                {"zero_optimization": zero, "bf16": {"enabled": True}})
    before = engine.comm_stats()
    tokens = torch.randint(0, CONFIG.vocab_size, (1, CONFIG.block_size + 1))
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
    engine.step()
    after = engine.comm_stats()
    grown = {kind: {key: after[kind][key] - before.get(kind, {}).get(key, 0) for key in after[kind]}
             for kind in after}
    return engine.memory_stats(), grown, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plan_matches_the_engine(fake_world, stage):
    memory, comm, params = one_step(stage)
    planned = estimate(make_scenario(from_architecture(ARCH), gpus_per_node=WORLD, seq_len=CONFIG.block_size),
                       stage)
    assert params == ARCH.total_params()  # the planner counts this model's parameters exactly

    plan_memory = planned.memory.engine_dict()
    assert set(memory) == set(plan_memory) == set(ENGINE_CATEGORIES)
    buckets = comm["reduce_scatter"]["calls"] or comm["all_reduce"]["calls"]  # one reduction per bucket
    padding = 4 * (WORLD - 1) * buckets  # at most N_d - 1 padded elements per bucket, 4 bytes at most each
    assert abs(memory["parameters"] - plan_memory["parameters"]) <= padding
    assert abs(memory["gradients"] - plan_memory["gradients"]) <= padding
    # Adam keeps a 4-byte step count per bucket, which the plan leaves out
    extra = memory["optimizer_state"] - plan_memory["optimizer_state"]
    assert 0 <= extra <= 4 * buckets + 12 * padding

    plan_comm = planned.comm.by_kind()
    assert set(plan_comm) <= set(comm) <= set(KINDS)
    for kind, run in comm.items():
        expected = plan_comm.get(kind, {"calls": 0, "elements": 0, "bytes": 0})
        assert set(run) == set(expected) == {"calls", "elements", "bytes"}
        norm = kind == "all_reduce" and stage > 0  # the one-scalar gradient-norm reduction, not bucketed
        assert run["calls"] == (1 if norm else PARAM_GROUPS) * expected["calls"], kind
        assert 0 <= run["elements"] - expected["elements"] <= (WORLD - 1) * run["calls"], kind
        assert run["bytes"] * expected["elements"] == expected["bytes"] * run["elements"], kind  # same dtype
