"""Stage 3 shards frozen parameters too (a LoRA-style fine-tune of a frozen base): each rank holds its
1/N of them, reports that, and still saves, trains and edits with their true values.
(Training parity with frozen parameters is in the parity matrix: stage3-*-norms-only-finetune, -frozen-*.)"""

from __future__ import annotations

import pytest
import torch

from zerokit.testing.parity import Case, make_model
from zerokit.testing.scenarios import run_stage3_frozen_checks
from zerokit.testing.spawn import spawn

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ranks():
    return spawn(run_stage3_frozen_checks, WORLD_SIZE)


def expected_state(meta: bool) -> dict[str, torch.Tensor]:
    case = Case("frozen", stage=3, freeze_matrices=True, min_unit_params=100, meta=meta)
    return make_model(case).state_dict()


def check_holds_a_shard(held: dict) -> None:
    total_bytes = 4 * held["frozen_numel"]  # fp32
    padding_bytes = 4 * held["frozen_units"] * (WORLD_SIZE - 1)  # each unit's buffer padded to a multiple of N
    assert total_bytes <= WORLD_SIZE * held["frozen_shard_bytes"] <= total_bytes + padding_bytes
    assert held["frozen_storage_bytes"] == {4}  # every frozen parameter holds one NaN, not its weights
    assert held["memory"]["parameters"] == held["trainable_shard_bytes"] + held["frozen_shard_bytes"]
    assert held["block_frozen_all_nan"]  # outside forward: loud NaN, as for trainable parameters
    assert held["block_frozen_shapes"]["0.mlp.0.weight"] == (96, 24)  # with its true shape


def test_a_rank_holds_only_its_shard_of_the_frozen_parameters(ranks) -> None:
    for out in ranks:
        assert out["frozen_units"] == 3  # the root and both blocks own frozen matrices
        for held in (out, out["after_step"], out["meta"]):
            check_holds_a_shard(held)


def test_full_state_dict_has_the_true_frozen_values(ranks) -> None:
    for out, meta in ((out, meta) for out in ranks for meta in (False, True)):
        expected = expected_state(meta)
        state = out["meta_state"] if meta else out["state_before"]
        assert set(state) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value.float(), rtol=0, atol=0, msg=name)


def test_training_leaves_frozen_values_alone_and_edits_are_kept(ranks) -> None:
    model = make_model(Case("frozen", stage=3, freeze_matrices=True, min_unit_params=100))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    for out in ranks:
        assert out["step"]["stepped"]
        before, after = out["state_before"], out["state_after"]
        assert all(torch.equal(before[name], after[name]) for name in frozen)
        assert any(not torch.equal(before[name], after[name]) for name in before if name not in frozen)
        assert torch.equal(out["after_edit"], torch.full((96, 24), 0.5))

