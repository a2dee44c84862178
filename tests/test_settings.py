"""The run's settings (issue 43): one resolve(config, facts) makes every room's part, once (See [Note: each room gets
its part] in zerokit/config/settings.py). Pure config work: no process group."""

from __future__ import annotations

import pytest

from zerokit.config.settings import Facts
from zerokit.config.typed import ZeroConfig, engine_settings, load_config, resolve

FACTS = Facts(world_size=4, backend="gloo")


@pytest.mark.parametrize("given", [ZeroConfig(tag_validation="Fail"), {"checkpoint": {"tag_validation": "fail"}}])
def test_tag_validation_reaches_the_checkpoint_part_from_a_typed_config_and_a_dict(given):
    _, parts = resolve(load_config(given), FACTS)
    assert parts.checkpoint.tag_validation == "Fail"
    assert resolve(ZeroConfig(), FACTS)[1].checkpoint.tag_validation == "Warn"


def test_a_tag_validation_that_is_no_choice_is_refused():
    with pytest.raises(ValueError, match="tag_validation='Sometimes'"):
        ZeroConfig(tag_validation="Sometimes")


def test_ranks_per_node_is_decided_once_the_config_over_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    _, parts = resolve(ZeroConfig(stage=3), Facts(world_size=4, backend="gloo", ranks_per_node=2))
    assert parts.decisions.ranks_per_node == parts.safeguards.ranks_per_node == 2
    _, parts = resolve(ZeroConfig(stage=3, ranks_per_node=4), Facts(world_size=4, backend="gloo", ranks_per_node=2))
    assert parts.decisions.ranks_per_node == parts.safeguards.ranks_per_node == 4
    assert engine_settings(ZeroConfig(stage=3), 4, "gloo").ranks_per_node == 2  # the launcher's, read when not given


def test_resolve_fills_auto_with_the_facts_and_hands_each_room_its_part():
    config, parts = resolve(load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                                         "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}),
                            Facts(world_size=4, backend="nccl", hidden_size=8, batch_ranks=4))
    assert config.train_batch_size == 8 and parts.observe.train_batch_size == 8
    assert parts.decisions.reduce_scatter and parts.decisions.world_size == 4
    assert parts.stage.stage == parts.checkpoint.stage == parts.safeguards.stage == 2
    assert parts.stage.offload is parts.offload
    assert parts.checkpoint.record["stage"] == 2 and parts.checkpoint.record["precision"]["param_dtype"] == "float32"
    assert ("config.stage", 2) in parts.safeguards.agreed


class _TwoTags:
    """A checkpoint group whose other rank proposed another tag."""

    def all_gather(self, proposal):
        return [proposal, ("other", "nonce1")]


@pytest.mark.parametrize("mode", ["Ignore", "Warn", "Fail"])
def test_a_save_reads_tag_validation_from_its_part(mode, caplog):
    from types import SimpleNamespace

    from zerokit.checkpoint.save import _agree_on_tag

    _, parts = resolve(ZeroConfig(tag_validation=mode), FACTS)
    engine = SimpleNamespace(parts=parts, rank=0, progress=SimpleNamespace(optimizer_step=3, total_skips=0))
    if mode == "Fail":
        with pytest.raises(ValueError, match="checkpoint.tag_validation is Fail"):
            _agree_on_tag(engine, _TwoTags(), "mine")
        return
    assert _agree_on_tag(engine, _TwoTags(), "mine")[0] == "mine"
    assert ("different checkpoint tags" in caplog.text) == (mode == "Warn")
