"""A model built on the meta device is materialised unit by unit: no rank ever holds all of it.
(Training parity of meta-built models is in the parity matrix: stage3-*-built-on-meta.)"""

from __future__ import annotations

import pytest
import torch

import zerokit
from zerokit.testing.models import TinyGPT, TinyGPTConfig, param_groups
from zerokit.testing.scenarios import run_meta_construction_checks
from zerokit.testing.spawn import spawn


@pytest.fixture(scope="module")
def ranks():
    return spawn(run_meta_construction_checks, 2)


def test_meta_model_holds_only_shards_after_initialize(ranks) -> None:
    for out in ranks:
        assert out["storage_bytes"] == {4}  # one shared NaN placeholder, nothing else, frozen parameters too
        frozen = 4 * (24 * 24 + 24) // 2  # this rank's half of the frozen layer
        assert out["memory"]["parameters"] == out["shard_bytes"] + frozen


def test_ranks_that_initialise_differently_are_caught(ranks) -> None:
    for out in ranks:
        assert "was initialised differently on different ranks" in out["divergent_error"]


def test_meta_model_needs_stage_3() -> None:
    with torch.device("meta"):
        model = TinyGPT(TinyGPTConfig())
    with pytest.raises(ValueError, match="a model on the meta device needs zero_optimization.stage=3"):
        zerokit.initialize(model, torch.optim.AdamW(param_groups(model)), {"zero_optimization": {"stage": 2}})


def test_pretrained_weights_stream_from_safetensors_into_a_meta_model(ranks) -> None:
    for out in ranks:
        assert set(out["loaded"]) == set(out["pretrained"])
        for name, value in out["pretrained"].items():  # lm_head.weight came through its tie to wte.weight
            assert torch.equal(out["loaded"][name], value), name
