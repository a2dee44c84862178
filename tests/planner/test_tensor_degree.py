"""The memo's "Inside the node" section (zerokit/planner/tensor_degree.py): each tensor degree that divides the node's
GPUs and the heads, at its fastest stage, checkpointing and largest micro-batch, beside the tree's pick; it says where
a tensor degree would change the pick. Llama-2-13B at 4,096 tokens on 8 A100s in one node."""

from __future__ import annotations

import pytest

from zerokit.planner import Policy, make_scenario, plan
from zerokit.planner.estimate import estimate
from zerokit.planner.memo import render_memo
from zerokit.planner.spec import Layout
from zerokit.planner.tensor_degree import pick_at_its_largest, tensor_degrees, tensor_options


def test_on_a100_80gb_no_tensor_degree_beats_flat_zero3() -> None:
    p = plan(model="llama2-13b", seq_len=4096, gpu="a100-80gb")
    assert tensor_degrees(p.scenario) == [2, 4, 8]  # 40 heads, 40 key-value heads, 8 GPUs
    options = tensor_options(p)
    base = pick_at_its_largest(p)
    assert p.pick.label == "ZeRO-3, no offload, no checkpointing"
    assert all(o.tokens_per_second < base.tokens_per_second for o in options)
    tp2 = options[0]  # tp=2 halves the activations per sample, so micro-batch 2 fits where flat fits 1
    assert tp2.training.micro_batch == 2
    assert tp2.memory.activations == pytest.approx(2 * base.memory.activations / 2)
    assert "the pick stands" in render_memo(p)


def test_on_a100_40gb_a_tensor_degree_avoids_recomputation_and_changes_the_pick() -> None:
    """The flat tree (Policy(tensor="none")) recomputes; the memo sets tp=4 beside it, faster without recomputation;
    and the tree with tensor degrees (the default) picks it: See [Note: a tensor degree in the tree]."""
    p = plan(make_scenario("llama2-13b", seq_len=4096, gpu="a100-40gb"), Policy(tensor="none", sequence="none"))
    assert p.pick.label == "ZeRO-3, no offload, full checkpointing"
    by_degree = {o.scenario.layout.tp: o for o in tensor_options(p)}
    tp4 = by_degree[4]
    assert tp4.training.checkpointing == "none" and tp4.fits
    flat = p.scenario.with_training(checkpointing="none", micro_batch=1)
    # activation memory / t: the flat layout's activations at the same micro-batch, divided by 4
    assert tp4.memory.activations == pytest.approx(estimate(flat, 3).memory.activations / 4, rel=1e-3)
    assert tp4.tokens_per_second > pick_at_its_largest(p).tokens_per_second * 1.15
    assert tp4.scenario.layout == Layout(tp=4)
    memo = render_memo(p)
    assert "## Inside the node: a tensor degree" in memo and "tp=4 with ZeRO-3 at micro-batch 1 would change the pick" in memo
    tree = plan(model="llama2-13b", seq_len=4096, gpu="a100-40gb", policy=Policy(sequence="none"))
    assert tree.pick.label == "ZeRO-3 + tp=4, no offload, no checkpointing"
    assert tree.pick.tokens_per_second == pytest.approx(tp4.tokens_per_second)
    tried = [a.label for a in tree.attempts]  # flat stages, then t = 2 and 4, each at stages 0-3, before offload
    assert tried[:4] == [f"ZeRO-{s}, no offload, no checkpointing" for s in range(4)]
    assert tried[4:12] == [f"ZeRO-{s} + tp={t}, no offload, no checkpointing" for t in (2, 4) for s in range(4)]
    why = next(r for r in tree.reasons if r.startswith("no stage fits flat"))
    assert "activations 32.2 GB -> 8.0 GB" in why and "tensor_parallel.autotp_size=4" in why
    assert "**ZeRO-3 + tp=4, no offload, no activation checkpointing, micro-batch 1**" in render_memo(tree)
