"""Stage 3 between steps: honest shapes, gathering to read and edit, inference, full state dict."""

from __future__ import annotations

import pytest
import torch

from zerokit.testing.parity import Case, make_model
from zerokit.testing.scenarios import run_stage3_access
from zerokit.testing.spawn import spawn


@pytest.fixture(scope="module")
def ranks():
    return spawn(run_stage3_access, 2)


def test_sharded_parameters_keep_their_shape_and_refuse_silent_use(ranks) -> None:
    for out in ranks:
        assert out["shape"] == (96, 24) and out["dtype"] == "torch.float32"
        assert out["sharded_is_nan"]  # computing with a sharded parameter is loud, not zeros


def test_gathered_values_and_full_state_dict_are_the_model(ranks) -> None:
    reference = make_model(Case("access", stage=3))
    expected = reference.state_dict()
    for out in ranks:
        torch.testing.assert_close(out["gathered"], expected["blocks.0.mlp.0.weight"], rtol=0, atol=0)
        assert set(out["state"]) == set(expected)  # tied lm_head.weight and buffers included
        for name, value in expected.items():
            torch.testing.assert_close(out["state"][name], value.float(), rtol=0, atol=0)


def test_inference_inside_unsharded_gathers_once(ranks) -> None:
    for out in ranks:
        assert out["gathers_in_context"] > 0
        torch.testing.assert_close(out["logits_in_context"], out["logits_eval"])
        # + this rank's half of the frozen layer (the root's; sharded like everything else at stage 3)
        assert out["memory_after_eval"]["parameters"] == out["shard_bytes"] + 4 * (24 * 24 + 24) // 2


def test_edits_written_back_survive_and_train(ranks) -> None:
    for out in ranks:
        assert torch.equal(out["after_edit"], torch.full((24,), 0.25))
        assert not torch.equal(out["after_step"], out["after_edit"])  # the step moved it from the edit...
        assert (out["after_step"] - 0.25).abs().max() < 0.01  # ...by one small update, not back to 0
    torch.testing.assert_close(ranks[0]["after_step"], ranks[1]["after_step"], rtol=0, atol=0)
