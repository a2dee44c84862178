"""DeepSpeed's `elasticity` block, accepted and honoured (issue 33, item 6): zerokit/config/dsconfig/elastic.py chooses the
global batch, micro-batch and accumulation for a world size as DeepSpeed's `compute_elastic_config` did (See [Note:
elastic batch sizes]). DeepSpeed 0.19.8 removed the function, so its results over a grid of 576 blocks and world sizes
1-8 were written by DeepSpeed 0.18.0's own code into tests/fixtures/elasticity/deepspeed_0.18.0.json
(tests/fixtures/elasticity/generate.py); where a DeepSpeed with the function is installed, it is asked directly too.
The restart at another world size is tests/test_restart_ranks.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerokit.config.typed import from_dict
from zerokit.config.dsconfig.elastic import ElasticPolicy, elastic_batch

FIXTURE = Path(__file__).parent / "fixtures" / "elasticity" / "deepspeed_0.18.0.json"
BLOCK = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [1, 2], "min_gpus": 1, "max_gpus": 4,
         "version": 0.1}


def zerokit_outcome(block: dict, world_size: int) -> list | str:
    try:
        chosen = elastic_batch(ElasticPolicy.from_block(block), world_size)
    except ValueError:
        return "error"
    assert chosen.accumulation * chosen.micro_batch * world_size == chosen.train_batch_size
    return [chosen.train_batch_size, chosen.micro_batch, list(chosen.valid_world_sizes)]


def test_the_batch_sizes_are_deepspeeds_over_the_grid() -> None:
    cases = json.loads(FIXTURE.read_text())["cases"]
    assert len(cases) == 576
    compared = refused = 0
    for case in cases:
        for size, wanted in case["outcomes"].items():
            got = zerokit_outcome(case["block"], int(size))
            if isinstance(wanted, str):  # DeepSpeed raised: an incompatible world size, no valid count, ...
                assert got == "error", (case["block"], size, wanted, got)
                refused += 1
            else:
                assert got == wanted, (case["block"], size, wanted, got)
                compared += 1
    assert compared > 3000 and refused > 100  # both kinds of outcome are exercised


def test_the_installed_deepspeed_agrees_where_it_still_has_the_function() -> None:
    elasticity = pytest.importorskip("deepspeed.elasticity", reason="DeepSpeed 0.19.8 removed elasticity")
    for case in json.loads(FIXTURE.read_text())["cases"][::17]:
        for size in range(1, 9):
            try:
                total, valid, micro = elasticity.compute_elastic_config({"elasticity": case["block"]}, "0.18.0",
                                                                        world_size=size)
            except Exception:
                assert zerokit_outcome(case["block"], size) == "error"
                continue
            assert zerokit_outcome(case["block"], size) == [int(total), int(micro), [int(v) for v in valid]]


@pytest.mark.parametrize("world_size,micro,accumulation", [(1, 2, 6), (2, 2, 3), (3, 2, 2), (4, 1, 3)])
def test_a_config_with_the_block_keeps_its_global_batch_at_every_world_size(world_size, micro, accumulation) -> None:
    config = from_dict({"zero_optimization": {"stage": 2}, "elasticity": BLOCK})
    assert config.pending_auto == ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    resolved = config.resolve(world_size=world_size)
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
            resolved.gradient_accumulation_steps) == (12, micro, accumulation)
    assert f"gradient_accumulation_steps: derived -> {accumulation} (elasticity at {world_size} ranks" in \
        "\n".join(resolved.startup_log_lines())


def test_batch_keys_beside_the_block_are_refused_unless_it_says_to_ignore_them() -> None:
    with pytest.raises(ValueError, match="train_batch_size given beside an enabled elasticity block"):
        from_dict({"train_batch_size": 8, "elasticity": BLOCK})
    ignored = from_dict({"train_batch_size": 8, "elasticity": {**BLOCK, "ignore_non_elastic_batch_info": True}})
    assert ignored.resolve(world_size=3).train_batch_size == 12


@pytest.mark.parametrize("change,words", [
    ({"micro_batch_sizes": [2, 0]}, "micro_batch_sizes"), ({"min_gpus": 5}, "min_gpus"),
    ({"version": 0.3}, "version"), ({"model_parallel_size": 2}, "data parallel only"),
    ({"max_gpus": 2}, "world size 3 is not one"),
])
def test_a_bad_block_or_world_size_is_one_line_naming_the_key(change, words) -> None:
    with pytest.raises(ValueError, match=words):
        from_dict({"elasticity": {**BLOCK, **change}}).resolve(world_size=3)


def test_a_disabled_block_asks_for_nothing() -> None:
    config = from_dict({"train_batch_size": 8, "elasticity": {"enabled": False}})
    assert config.resolve(world_size=2).train_batch_size == 8
