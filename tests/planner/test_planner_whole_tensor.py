"""Whole-tensor optimizers in the planner: Muon's and Adafactor's K, and their parameters moving by reduce and
broadcast instead of reduce-scatter and all-gather (See [Note: whole-tensor optimizers] in memory.py)."""

from __future__ import annotations

import pytest

from zerokit.planner import estimate, make_scenario
from zerokit.planner.comms import wire_factor
from zerokit.planner.memory import optimizer_state_bytes
from zerokit.planner.spec import Training

P13 = 13_015_864_320  # Llama-2-13B
ROOT13 = 327_685_120 + 40 * 2 * 5_120  # embedding, head, final norm and every block's norms (the root unit)
BLOCKS13 = P13 - ROOT13


def run(stage: int, optimizer: str, **kwargs):
    kwargs.setdefault("seq_len", 4096)
    return estimate(make_scenario("llama2-13b", optimizer=optimizer, **kwargs), stage)


def test_k_of_muon_and_adafactor() -> None:
    k = {(o, p): optimizer_state_bytes(Training(optimizer=o, precision=p))
         for o in ("muon", "adafactor") for p in ("bf16", "fp32")}
    # Muon: 4 master + 4 momentum, fp32: the momentum; Adafactor: the master, its factored moment is O(rows + cols)
    assert k == {("muon", "bf16"): 8, ("muon", "fp32"): 4, ("adafactor", "bf16"): 4, ("adafactor", "fp32"): 0}


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_muon_steps_the_blocks_and_adamw_the_rest(stage: int) -> None:
    """bf16, 8 ranks: Muon's 8 bytes on the blocks' matrices, AdamW's 12 on the root (embeddings, head, norms)."""
    held = P13 if stage == 0 else -(-P13 // 8)
    expected = -(-held * (8 * BLOCKS13 + 12 * ROOT13) // P13)
    assert run(stage, "muon").memory.optimizer_state == pytest.approx(expected, abs=1)
    assert run(stage, "adafactor").memory.optimizer_state == 4 * held


def test_whole_tensor_parameters_are_reduced_and_broadcast() -> None:
    """Stage 2 on nccl: the blocks' gradients reduced to their owner and their updates broadcast from it; the
    root's reduce-scattered and all-gathered as before. Same elements in all."""
    muon = run(2, "muon").comm.by_kind()
    assert muon["reduce"]["elements"] == muon["broadcast"]["elements"] == BLOCKS13
    assert muon["reduce_scatter"]["elements"] == muon["all_gather"]["elements"] == ROOT13
    adafactor = run(2, "adafactor").comm.by_kind()
    assert adafactor["reduce"]["elements"] == adafactor["broadcast"]["elements"] == P13
    assert "reduce_scatter" not in adafactor and "all_gather" not in adafactor
    on_gloo = run(2, "adafactor", backend="gloo").comm.by_kind()  # gloo: every bucket all-reduced, owner or not
    assert on_gloo["all_reduce"]["elements"] == P13 + 1 and "reduce" not in on_gloo


def test_stage3_broadcasts_the_blocks_from_their_owners() -> None:
    """Muon at stage 3: the blocks are broadcast before forward and backward; the root all-gathered once."""
    stats = run(3, "muon").comm.by_kind()
    assert stats["broadcast"]["elements"] == 2 * BLOCKS13
    assert stats["all_gather"]["elements"] == ROOT13
    assert stats["reduce"]["elements"] == BLOCKS13 and stats["reduce_scatter"]["elements"] == ROOT13


def test_broadcast_and_reduce_move_the_whole_tensor_per_link() -> None:
    assert wire_factor("broadcast", 8) == wire_factor("reduce", 8) == 1.0


def test_the_exact_engine_model_names_its_optimizers() -> None:
    from zerokit.planner.engine_model import EngineSetup

    with pytest.raises(ValueError, match="muon"):
        EngineSetup(stage=1, world=2, optimizer="muon")
