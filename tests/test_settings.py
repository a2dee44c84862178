"""The run's settings (issue 43): one resolve(config, facts) makes every room's part, once (See [Note: each room gets
its part] in zerokit/config/settings.py). Pure config work: no process group."""

from __future__ import annotations

import pytest

from zerokit.config.settings import Facts
from zerokit.config.resolve import engine_settings, resolve
from zerokit.config.typed import ZeroConfig, load_config

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


def test_the_dict_is_read_once_resolve_fills_in_from_what_the_reader_recorded(monkeypatch):
    """load_config reads the DeepSpeed dict; resolve fills in what needs the world size and the model from the values
    the reader recorded (ZeroConfig.unknowns) and the config's own fields, never from the dict again."""
    from zerokit.config.dsconfig import DeepSpeedConfig

    config = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                "stage3_prefetch_bucket_size": "auto"}})

    def refuse(*_args, **_kwargs):
        raise AssertionError("the DeepSpeed dict was read again")

    monkeypatch.setattr(DeepSpeedConfig, "get", refuse)
    monkeypatch.setattr(DeepSpeedConfig, "given", refuse)
    resolved, parts = resolve(config, Facts(world_size=4, backend="gloo", hidden_size=8))
    assert (resolved.gradient_accumulation_steps, resolved.reduce_bucket_bytes) == (2, 8 * 8 * 4)
    assert resolved.stage3.prefetch_numel == int(0.9 * 64) and resolved.pending_auto == ()
    assert parts.step.gradient_accumulation_steps == 2 and parts.decisions.bucket_numel == 64
    assert "communication_data_type not set: gradients are reduced in fp32 (DeepSpeed reduces in the compute dtype, " \
           "bf16)" in parts.startup_lines
    assert resolved.resolve(world_size=4, hidden_size=8) is resolved  # resolved once: nothing left to fill in


def test_the_nodes_are_decided_once_for_the_tiers_and_the_node_check():
    """The ranks a node's host memory and NVMe hold, and the node torchrun's GROUP_RANK is checked against, come from
    the one decision (settings.ranks_per_node), not from the environment read again in the rooms."""
    facts = Facts(world_size=4, backend="gloo", ranks_per_node=2, node_rank=1)
    _, parts = resolve(ZeroConfig(stage=3), facts)
    assert parts.offload.ranks_per_node == parts.decisions.ranks_per_node == 2
    assert parts.safeguards.node_rank == 1  # the nodes are torchrun's: consecutive numbering is checked
    _, parts = resolve(ZeroConfig(stage=3, ranks_per_node=4), facts)
    # the config's nodes, not torchrun's: nothing to check GROUP_RANK against
    assert parts.offload.ranks_per_node == 4 and parts.safeguards.node_rank is None
    _, parts = resolve(ZeroConfig(stage=3), Facts(world_size=4, backend="gloo", ranks_per_node=3))
    assert parts.offload.ranks_per_node == 4  # 3 does not divide 4 ranks: one node, as the decisions say


@pytest.mark.parametrize("zero", [{"stage": 2}, {"stage": 3, "mics_shard_size": 2, "reduce_scatter": True},
                                  {"stage": 3, "zero_hpz_partition_size": 2}])
def test_the_planner_decides_with_the_engines_decide(zero):
    """The planner's engine model makes its decisions with settings.decide, from the same choices a config makes
    (EngineChoices) and the facts it predicts; resolve decides with it too."""
    from zerokit.planner.engine_model import EngineSetup

    config = load_config({"zero_optimization": {**zero, "reduce_bucket_size": 1000}, "ranks_per_node": 2})
    _, parts = resolve(config, Facts(world_size=4, backend="nccl"))
    setup = EngineSetup(stage=zero["stage"], world=4, backend="nccl", device="cuda", bucket_bytes=4000,
                        reduce_scatter=zero.get("reduce_scatter"), mics_shard_size=zero.get("mics_shard_size"),
                        hpz_partition_size=zero.get("zero_hpz_partition_size"), ranks_per_node=2)
    assert setup.settings == parts.decisions
