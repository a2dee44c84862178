"""The planner's sequence degree (issue 47, item 6): Ulysses in the activation model, its all-to-alls in the
communication model, tiling in both, and the tree trying a sequence degree before a tensor degree and before
offloading (See [Note: a sequence degree in the tree] in zerokit/planner/advice.py)."""

from __future__ import annotations

import dataclasses

import pytest

from zerokit.planner.advice import plan
from zerokit.planner.emit import emit
from zerokit.planner.estimate import estimate, make_scenario
from zerokit.planner.spec import Layout, Policy

LONG = {"model": "llama2-13b", "seq_len": 4096, "gpu": "a100-40gb"}  # activations overflow a 40 GB card
LONG_ENOUGH = {"model": "llama3-8b", "seq_len": 16384, "gpu": "a100-80gb"}


def test_a_sequence_degree_splits_the_activations_by_its_ranks() -> None:
    flat = make_scenario(**LONG)
    for sp in (2, 4, 8):
        split = dataclasses.replace(flat, layout=Layout(sp=sp))
        assert estimate(split, 3).memory.activations == pytest.approx(estimate(flat, 3).memory.activations / sp,
                                                                       rel=1e-6)
        # the model states do not move: ZeRO still shards them over every rank
        assert estimate(split, 3).memory.model_states == estimate(flat, 3).memory.model_states


def test_its_all_to_alls_move_four_tensors_of_a_ranks_tokens_per_block_each_way() -> None:
    scenario = dataclasses.replace(make_scenario(**LONG), layout=Layout(sp=4))
    arch = scenario.model.architecture
    (exchange,) = [c for c in estimate(scenario, 3).comm.collectives if c.kind == "all_to_all"]
    assert exchange.group == "sp" and exchange.calls == 2 * 4 * arch.n_layers
    assert exchange.elements == 2 * arch.n_layers * (4096 // 4) * (2 * arch.q_dim + 2 * arch.kv_dim)
    assert exchange.wire_bytes == pytest.approx(exchange.bytes * 3 / 4, rel=1e-6)  # (sp - 1) / sp leaves


def test_the_tree_tries_sequence_and_tensor_degrees_together_before_offload() -> None:
    """Llama-3-8B at 16k tokens on A100-80GB: no flat stage fits (activations 96.8 GB); at degree 2 both forms fit
    at ZeRO-3 (tp=2 at ZeRO-2 too), and sp=2 is the fastest: it gathers the whole model for half the sequences, but
    its all-to-alls move less than tp=2's all-reduces of whole activations."""
    p = plan(**LONG_ENOUGH)
    assert p.pick.label == "ZeRO-3 + sp=2, no offload, no checkpointing"
    tried = [a.label for a in p.attempts]
    assert tried[:4] == [f"ZeRO-{s}, no offload, no checkpointing" for s in range(4)]
    assert tried[4:12] == [f"ZeRO-{s} + {form}=2, no offload, no checkpointing" for form in ("sp", "tp")
                           for s in range(4)]
    why = next(r for r in p.reasons if "sequence and tensor degrees" in r)
    assert "sp=2 keeps 8192 of each sequence's 16384 tokens" in why and "sequence_parallel_size=2" in why
    assert any(r.startswith("beside it ZeRO-3 + tp=2") for r in p.reasons)
    without = plan(**LONG_ENOUGH, policy=Policy(sequence="none"))
    assert without.pick.scenario.layout == Layout(tp=2) and p.pick.tokens_per_second > without.pick.tokens_per_second


def test_tiling_trades_the_mlp_and_logits_memory_for_their_recomputation() -> None:
    untiled = estimate(make_scenario(**LONG), 3)
    tiled = estimate(make_scenario(**LONG, tiles=4), 3)
    assert tiled.memory.activations < untiled.memory.activations / 2
    assert tiled.compute.seconds > untiled.compute.seconds  # each slice's forward again in backward


def test_the_emitted_configs_carry_the_degree() -> None:
    pick = plan(**LONG_ENOUGH).pick
    for target in ("zerokit", "deepspeed"):
        emitted = emit(pick, target, 1.0)
        assert emitted.config["sequence_parallel_size"] == 2
        assert any("sequence_parallel_size=2" in note for note in emitted.notes)
    with pytest.raises(ValueError, match="--emit fsdp writes data-parallel code"):
        emit(pick, "fsdp", 1.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"sp": 3, "gpus_per_node": 6}, "sp=3 does not split 40 attention heads"),
    ({"sp": 2, "seq_len": 4095}, "sp=2 does not divide the sequence length 4095"),
    ({"sp": 2, "tp": 2}, "sequence parallelism (sp=2) composes with ZeRO's data parallelism"),
])
def test_a_degree_that_does_not_fit_is_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_scenario(**{**LONG, **kwargs})
