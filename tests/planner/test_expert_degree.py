"""The planner's expert degree (issue 45, item 7): mixture-of-experts shapes and presets, memory per rank by category
with the experts sharded over their expert-data group, the all-to-alls of dispatch and combine, and the tree trying
expert degrees before offloading (See [Note: the expert degree] in zerokit/planner/memory.py and [Note: an expert
degree in the tree] in zerokit/planner/advice.py); then the plan against a run whose experts are split: a tiny Mixtral
on 4 gloo ranks at an expert degree of 2 (one spawn serves every case), its model states and every collective exact on
every rank at ZeRO 0-3, and recorded at ZeRO 1 and 3 with record_run, checked row by row (See [Note: split experts in
the engine model] in zerokit/planner/engine_model.py)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import zerokit.cli
from zerokit.planner.advice import plan
from zerokit.planner.check import check_rows
from zerokit.planner.emit import emit
from zerokit.planner.engine_model import EngineSetup, ParamEntry, ParamInventory, engine_comm, engine_states
from zerokit.planner.engine_offload import engine_transfers
from zerokit.planner.estimate import estimate, make_scenario
from zerokit.planner.memo import render_memo
from zerokit.planner.models import PRESETS, Architecture, Experts, from_hf_dict
from zerokit.planner.spec import Layout, Policy

# A made-up MoE small enough to count by hand: 2 blocks, hidden 64, 4 heads, 4 experts of width 96, top-2.
TINY = Architecture(n_layers=2, hidden=64, n_heads=4, n_kv_heads=4, ffn=128, vocab=1000,
                    experts=Experts(count=4, top_k=2, ffn=96))
ATTENTION = 4 * 64 * 64 + 2 * 64  # q, k, v, o and the block's two RMSNorms
EXPERT = 3 * 64 * 96  # gate, up, down
BLOCK = ATTENTION + 64 * 4 + 4 * EXPERT  # + the router (hidden x experts)
TOTAL = 2 * BLOCK + 2 * 1000 * 64 + 64  # embedding, untied head, final norm: 309,056
ROUTED = 2 * 4 * EXPERT  # 147,456
MIXTRAL = {"model": "mixtral-8x7b", "gpu": "a100-80gb", "gpus_per_node": 8, "seq_len": 4096}


@pytest.mark.parametrize("key, total, active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)])
def test_the_presets_count_the_published_parameters(key: str, total: float, active: float) -> None:
    arch = PRESETS[key].architecture
    assert PRESETS[key].total_params == pytest.approx(total, rel=0.01)
    # active counts are published to a tenth of a billion (Qwen3-30B-A3B's 3.353B is quoted as 3.3B)
    assert arch.active_params() == pytest.approx(active, abs=0.055e9)
    assert PRESETS["mixtral-8x7b"].total_params == 46_702_792_704  # the Hugging Face checkpoint's count


MIXTRAL_CONFIG = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                  "num_experts_per_tok": 2, "vocab_size": 32000}
QWEN15_MOE = {"model_type": "qwen2_moe", "num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
              "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
              "vocab_size": 151936}
DEEPSEEK_MOE_16B = {"model_type": "deepseek", "num_hidden_layers": 28, "hidden_size": 2048,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
                    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "vocab_size": 102400}


@pytest.mark.parametrize("config, total, active", [
    (MIXTRAL_CONFIG, 46.7e9, 12.9e9),  # Mixtral of Experts (Jiang et al. 2024)
    (QWEN15_MOE, 14.3e9, 2.7e9),  # Qwen1.5-MoE-A2.7B model card
    (DEEPSEEK_MOE_16B, 16.4e9, 2.8e9),  # DeepSeekMoE (Dai et al. 2024): 16.4B, 2.8B activated
])
def test_hugging_face_configs_of_each_family_count_the_published_totals(config: dict, total: float,
                                                                        active: float) -> None:
    spec = from_hf_dict(config)
    assert spec.total_params == pytest.approx(total, rel=0.01)
    assert spec.architecture.active_params() == pytest.approx(active, abs=0.055e9)


def test_the_tiny_model_counts_by_hand() -> None:
    assert TINY.total_params() == TOTAL == 309_056 and TINY.routed_expert_params() == ROUTED
    assert TINY.active_params() == TOTAL - 2 * 2 * EXPERT  # two of the four experts in each layer


def _by_hand(stage: int, parts: list[tuple[int, int]]) -> dict[str, int]:
    """bf16 AdamW, fp32 reduction: each (elements on the rank, ranks sharding them) as the ZeRO paper counts it."""
    out = {"parameters": 0, "gradients": 0, "optimizer_state": 0}
    for elements, shard in parts:
        sharded = -(-elements // shard)
        out["parameters"] += 0 if stage == 3 else 2 * elements  # stage 3: the fp32 master shards are the parameters
        out["gradients"] += {0: 2 * elements + 4 * elements, 1: 2 * elements + 4 * sharded}.get(stage, 4 * sharded)
        out["optimizer_state"] += 12 * (elements if stage == 0 else sharded)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_bytes_by_category_with_and_without_an_expert_degree(stage: int) -> None:
    """4 GPUs. Flat: everything over the 4 ranks. ep=2: the dense part (all but the routed experts) over 4 ranks, and
    half the experts (2 of 4 per layer) over their expert-data group of 2."""
    flat = make_scenario(TINY, gpus_per_node=4, seq_len=128)
    split = make_scenario(TINY, gpus_per_node=4, seq_len=128, ep=2)
    dense, experts = TOTAL - ROUTED, ROUTED // 2
    assert estimate(flat, stage).memory.engine_dict() == _by_hand(stage, [(TOTAL, 4)])
    assert estimate(split, stage).memory.engine_dict() == _by_hand(stage, [(dense, 4), (experts, 2)])
    # activations do not depend on where the experts live
    assert estimate(split, stage).memory.activations == estimate(flat, stage).memory.activations


def test_the_all_to_alls_carry_the_routed_tokens_each_way() -> None:
    """Per MoE layer: dispatch and combine forward, both again backward; each of tokens x top-k x hidden x 2 bytes,
    (ep - 1) / ep of it leaving the rank."""
    scenario = make_scenario(TINY, gpus_per_node=4, seq_len=128, ep=2)
    (exchange,) = [c for c in estimate(scenario, 1).comm.collectives if c.kind == "all_to_all"]
    assert exchange.group == "ep" and exchange.group_size == 2 and exchange.link == "NVLink 3"
    assert exchange.calls == 2 * 2 * 2  # 2 layers x (dispatch, combine) x (forward, backward)
    assert exchange.bytes == 8 * 128 * 2 * 64 * 2 and exchange.wire_bytes == exchange.bytes // 2
    flat = make_scenario(TINY, gpus_per_node=4, seq_len=128)
    assert not [c for c in estimate(flat, 1).comm.collectives if c.kind == "all_to_all"]
    # ZeRO's collectives for the experts run over their expert-data group of 2, the dense part's over all 4
    groups = {(c.kind, c.group, c.group_size, c.elements) for c in estimate(scenario, 1).comm.collectives}
    assert ("reduce_scatter", "ep_data", 2, ROUTED // 2) in groups
    assert ("reduce_scatter", "dp_shard", 4, TOTAL - ROUTED) in groups


def test_compute_counts_only_the_active_parameters() -> None:
    e = estimate(make_scenario(**MIXTRAL), 3)
    forward = e.compute.flops_per_token / 3  # no recomputation: backward is twice the forward
    arch = PRESETS["mixtral-8x7b"].architecture
    assert forward == pytest.approx(2 * arch.matmul_params() + 4 * 32 * 4096 * 4096, rel=1e-9)
    assert arch.matmul_params() < 0.3 * arch.total_params()


def test_the_tree_tries_expert_degrees_before_offload() -> None:
    """Mixtral-8x7B with LoRA adapters on 8 A100-80GB at 4096 tokens: the frozen experts' 93 GB of parameters keep
    flat stages 0-2 off the GPU, and stage 3's gather of whole MoE blocks (24.8 GB of buffers) keeps it over by 2 GB;
    an expert degree fits with nothing offloaded."""
    p = plan(**MIXTRAL, lora_rank=16)
    assert p.pick.scenario.layout.ep > 1 and not p.pick.offload.any
    flat = [a for a in p.attempts if a.scenario.layout == Layout()]
    assert [a.stage for a in flat] == [0, 1, 2, 3] and not any(a.fits for a in flat)
    assert not any(a.offload.any for a in p.attempts)
    why = next(r for r in p.reasons if "expert degrees inside the node" in r)
    assert f"expert_parallel_size={p.pick.scenario.layout.ep}" in why and "all-to-alls" in why
    assert plan(**MIXTRAL, lora_rank=16, policy=Policy(expert="none")).pick.scenario.layout.ep == 1


def test_fully_trained_mixtral_offloads_beside_an_expert_degree() -> None:
    """Fully trained, the model states alone (18 B x 46.7B / 8 = 105 GB) overflow at every stage and degree; the first
    offload tier's stage 1 fits with ep=8, which keeps 1 expert of 8 per layer on a GPU."""
    p = plan(**MIXTRAL)
    assert p.pick.label == "ZeRO-1 + ep=8, optimizer->cpu, no checkpointing"
    assert not any(a.fits for a in p.attempts if not a.offload.any)
    memo = render_memo(p)
    assert "## Mixture of experts: with and without an expert degree" in memo
    assert "| ep=8 (experts) | ZeRO-1 | yes | 14.49 |" in memo
    assert "| flat data parallel | ZeRO-1 | no | 93.41 |" in memo


def test_the_emitted_configs_carry_the_degree_where_the_target_has_a_key() -> None:
    pick = plan(**MIXTRAL).pick
    assert emit(pick, "zerokit", 1.0).config["expert_parallel_size"] == 8
    deepspeed = emit(pick, "deepspeed", 1.0)  # DeepSpeed 0.19.8's AutoEP block, and no zerokit key
    assert deepspeed.config["expert_parallel"] == {"enabled": True, "autoep_size": 8}
    assert "expert_parallel_size" not in deepspeed.config
    assert any("AutoEP" in note and "ep_size=8" in note for note in deepspeed.notes)
    with pytest.raises(ValueError, match="--emit fsdp writes data-parallel code"):
        emit(pick, "fsdp", 1.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"ep": 4, "gpus_per_node": 6}, "ep=4 does not divide the 6 GPUs"),
    ({"ep": 3, "gpus_per_node": 6}, "ep=3 does not divide the 8 experts"),
    ({"ep": 2, "model": "llama2-7b"}, "ep=2 needs a mixture-of-experts model"),
    ({"ep": 2, "tp": 2}, "the planner prices expert parallelism (ep=2) over flat data parallelism only"),
])
def test_a_degree_that_does_not_fit_is_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        make_scenario(**{**MIXTRAL, **kwargs})
    assert "\n" not in str(error.value)


def test_top_k_above_the_experts_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="top-k=5 is above the 4 experts"):
        dataclasses.replace(TINY, experts=Experts(count=4, top_k=5, ffn=96))
    with pytest.raises(ValueError, match="multi-head latent attention"):
        from_hf_dict({"model_type": "deepseek_v3"})


def test_the_cli_takes_a_degree_and_refuses_a_bad_one(capsys) -> None:
    assert zerokit.cli.main(["plan", "--model", "mixtral-8x7b", "--seq-len", "4096", "--ep", "8",
                             "--emit", "zerokit"]) == 0
    assert '"expert_parallel_size": 8' in capsys.readouterr().out
    assert zerokit.cli.main(["plan", "--model", "mixtral-8x7b", "--ep", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ep=3" in err


# --- the plan against runs with split experts ---------------------------------------------------------------------
SPLIT_RANKS, SPLIT_EP = 4, 2  # 2 expert groups of 2 ranks; each rank's 2 experts a layer shard over 2 ranks
TINY_MIXTRAL = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
SPLIT_CASES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu")]
RECORDED_STAGES = (3, 1)


def _split_mixtral(stage: int, offload: str = "none") -> tuple:
    import torch
    import transformers

    import zerokit
    from zerokit.testing.models import param_groups

    torch.manual_seed(0)
    net = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY_MIXTRAL))
    optimizer = torch.optim.AdamW(param_groups(net))
    # small buckets (several per stage) and a low persistence threshold (the blocks are units, the norms the root's)
    zero = {"stage": stage, "reduce_bucket_bytes": 40_000, "stage3_param_persistence_threshold": 100,
            **({"offload_optimizer": {"device": offload}} if offload != "none" else {})}
    engine = zerokit.initialize(net, optimizer, {"zero_optimization": zero, "bf16": {"enabled": True},
                                                 "expert_parallel": {"enabled": True, "autoep_size": SPLIT_EP}})
    return net, optimizer, engine


def _split_states_and_counts(rank: int, stage: int, offload: str) -> dict:
    """memory_stats() after backward and after the step, and comm_stats()' growth over the second step."""
    from dataclasses import asdict

    import torch

    from zerokit.profiling.inventory import param_inventory
    from zerokit.profiling.record import engine_setup

    net, optimizer, engine = _split_mixtral(stage, offload)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the second step: the optimizer's state exists
        before = engine.comm_stats()
        tokens = torch.randint(0, TINY_MIXTRAL["vocab_size"], (2, 16), generator=generator)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        after_backward = engine.memory_stats()
        engine.step()
    after = engine.comm_stats()
    run = {"after_backward": after_backward, "after_step": engine.memory_stats(),
           "comm": {k: {key: after[k][key] - before[k][key] for key in after[k]} for k in after
                    if after[k]["calls"] != before[k]["calls"]},
           "inventory": param_inventory(net, optimizer, engine.config.stage3).as_dict(),
           "setup": asdict(engine_setup(engine, "adamw"))}
    engine.close()
    return run


def _recorded_split_mixtral(rank: int, stage: int) -> dict:
    from dataclasses import asdict

    import torch

    from zerokit.profiling.record import record_run

    net, optimizer, engine = _split_mixtral(stage)
    generator = torch.Generator().manual_seed(rank)
    batches = iter(lambda: torch.randint(0, TINY_MIXTRAL["vocab_size"], (2, 32), generator=generator), None)
    record = record_run(engine, batches, lambda e, tokens: e(input_ids=tokens, labels=tokens).loss,
                        optimizer=optimizer, micro_batch=2, seq_len=32, warmup=1, steps=1)
    engine.close()
    return asdict(record)


def _split_runs(rank: int, world: int) -> dict:
    runs = {case: _split_states_and_counts(rank, *case) for case in SPLIT_CASES}
    runs.update({f"record {stage}": _recorded_split_mixtral(rank, stage) for stage in RECORDED_STAGES})
    return runs


@functools.lru_cache(maxsize=None)
def split_runs() -> list[dict]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from zerokit.testing.spawn import spawn

    return spawn(_split_runs, SPLIT_RANKS, timeout=600)


@pytest.mark.parametrize("stage, offload", SPLIT_CASES)
def test_split_experts_states_and_collectives_are_exact_on_every_rank(stage: int, offload: str) -> None:
    """Each rank's memory_stats() and comm_stats() from the plan's two stages (the dense one over 4 ranks, the experts'
    over their expert-data group of 2, rank r at place r // 2 of it), to the byte; with the optimizer on the host, its
    transfers too. (Under optimizer offload the engine keeps its host gradients after the step, with experts or
    without, which engine_states does not count: only the state after backward is compared there.)"""
    for rank, out in enumerate(split_runs()):
        run = out[(stage, offload)]
        setup, inventory = EngineSetup(**run["setup"]), ParamInventory.from_dict(run["inventory"])
        assert setup.expert == SPLIT_EP
        states = engine_states(inventory, setup, rank)
        assert states.after_backward == run["after_backward"], rank
        if offload == "none":
            assert states.after_step == run["after_step"], rank
        assert engine_comm(inventory, setup, rank) | engine_transfers(inventory, setup, rank) == run["comm"], rank


@pytest.mark.parametrize("stage", RECORDED_STAGES)
def test_the_plan_meets_a_recorded_mixtral_with_split_experts(stage: int) -> None:
    """record_run at ZeRO 3 and 1, checked by check_rows: every model-state category and every collective kind to the
    byte, the expert exchange's all-to-alls exactly in a rank's mean; the sharded categories by hand: the dense part
    over the 4 ranks, each rank's experts over their 2."""
    from zerokit.profiling.record import engine_config

    record = split_runs()[0][f"record {stage}"]
    assert record["setup"]["expert"] == SPLIT_EP
    assert engine_config(record["setup"])["expert_parallel"] == {"enabled": True, "autoep_size": SPLIT_EP}
    rows = {row.category: row for row in check_rows(record)}
    states = [name + after for name in ("parameters", "gradients", "optimizer_state") for after in ("", "_after_step")]
    kinds = [f"{kind}.{key}" for kind in record["measured"]["comm_per_step"] for key in ("calls", "elements", "bytes")]
    for name in states + kinds + ["wire_bytes", "all_to_all.calls", "all_to_all.elements", "all_to_all.bytes"]:
        assert rows[name].error == 0, (name, rows[name])
    entries = [ParamEntry(**e) for e in record["inventory"]["entries"]]
    dense, experts = (sum(e.numel for e in entries if e.expert == split) for split in (False, True))
    assert experts == 2 * 2 * 3 * 32 * 48  # 2 layers x this rank's 2 experts x (gate, up, down)
    # the fp32 reduced gradient shards; at stage 1 beside the whole bf16 gradient buffer
    shards = 4 * (dense // SPLIT_RANKS + experts // (SPLIT_RANKS // SPLIT_EP))
    assert rows["gradients"].measured == shards + (2 * (dense + experts) if stage == 1 else 0)
    # 2 MoE layers x dispatch and combine, forward and backward, each of 64 tokens x top-2 x hidden 32, in bf16
    assert (rows["all_to_all.calls"].measured, rows["all_to_all.bytes"].measured) == (8, 8 * 64 * 2 * 32 * 2)


@pytest.mark.parametrize("changes, message", [
    ({"expert": 3}, "expert=3 does not divide the 4 ranks"),
    ({"expert": 2, "sequence": 2}, "expert=2 beside a sequence degree, MiCS or NVMe offload"),
    ({"expert": 2, "mics_shard_size": 2}, "expert=2 beside a sequence degree, MiCS or NVMe offload"),
])
def test_an_expert_degree_the_engine_refuses_is_refused_in_one_line(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        EngineSetup(stage=2, world=4, **changes)
    assert "\n" not in str(error.value)


def test_an_expert_degree_needs_the_experts_marked_in_the_inventory() -> None:
    """An inventory recorded before split experts were marked holds no expert entry: refused, not priced as flat."""
    inventory = ParamInventory((ParamEntry("w", 64, 0, 0),))
    with pytest.raises(ValueError, match="marks no trainable expert parameter"):
        engine_states(inventory, EngineSetup(stage=2, world=4, expert=2))
