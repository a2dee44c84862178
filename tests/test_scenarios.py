"""Overflow seen by one rank only is agreed on by all, at every stage, in bf16 and in fp16 with dynamic loss
scaling; endless overflow fails loudly."""

from __future__ import annotations

import pytest
import torch

from zerokit.testing.scenarios import OVERFLOW_SETTINGS, run_overflow_scenarios
from zerokit.testing.spawn import spawn


@pytest.fixture(scope="module")
def every_setting():
    return spawn(run_overflow_scenarios, 2)


@pytest.fixture(params=[f"stage{s}-{d}" for s, d in OVERFLOW_SETTINGS])
def scenarios(every_setting, request):
    """Each rank's results for one stage and 16-bit dtype (fp16 with dynamic loss scaling)."""
    return [ranks[request.param] for ranks in every_setting]


def test_overflow_on_one_shard_skips_the_step_on_every_rank(scenarios) -> None:
    for out in scenarios:
        agree = out["agree"]
        assert agree["error"] is None
        assert [r["skipped"] for r in agree["results"]] == [False, True, False, False]
        snapshots = agree["snapshots"]
        assert all(torch.equal(snapshots[0][k], snapshots[1][k]) for k in snapshots[0])  # nothing moved
        assert any(not torch.equal(snapshots[1][k], snapshots[2][k]) for k in snapshots[1])  # then it trains
    for name, value in scenarios[0]["agree"]["snapshots"][-1].items():
        assert torch.equal(value, scenarios[1]["agree"]["snapshots"][-1][name])  # ranks never diverged


def test_consecutive_skips_raise_instead_of_silently_not_training(scenarios) -> None:
    for out in scenarios:
        fail = out["fail_loud"]
        assert [r["consecutive_skips"] for r in fail["results"]] == [1, 2]
        assert fail["error"].startswith("3 optimizer steps in a row were skipped for inf/nan gradients")
