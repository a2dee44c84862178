"""Stage 3's units in one process: which modules become units and which unit owns each parameter
(See [Note: units and tied parameters] and [Note: nested units] in zerokit/stages/units.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from zerokit.config.typed import Stage3Policy, from_dict
from zerokit.stages.units import Unit, find_units
from zerokit.testing.models import Block, CausalSelfAttention, TinyGPT, TinyGPTConfig


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.own = nn.Linear(4, 4)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Outer()
        self.second = Outer()
        self.head = nn.Linear(4, 4)


def tiny() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig())


def owners(model: nn.Module, units: list[Unit]) -> dict[str, str]:
    """Parameter name (every name of a tied one) -> the name of the unit that owns it; checks that the
    units split the parameters exactly: each owned once, none left out."""
    owned = [param_id for unit in units for param_id in unit.param_ids]
    assert len(owned) == len(set(owned)) and set(owned) == {id(p) for p in model.parameters()}
    owner_of = {param_id: unit.name for unit in units for param_id in unit.param_ids}
    return {name: owner_of[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def test_class_names_make_units() -> None:
    model = tiny()
    units = find_units(model, Stage3Policy(persistence_threshold=0, unit_classes=("Block",)))
    assert [(u.name, u.parent) for u in units] == [("<root>", None), ("blocks.0", 0), ("blocks.1", 0)]
    owner = owners(model, units)
    assert owner["blocks.1.mlp.0.weight"] == "blocks.1"
    assert owner["wte.weight"] == owner["lm_head.weight"] == owner["sometimes.weight"] == "<root>"


def test_a_single_string_is_one_name_not_its_letters() -> None:
    assert Stage3Policy(unit_classes="Block").unit_classes == ("Block",)
    config = from_dict({"zero_optimization": {"stage": 3, "stage3_unit_classes": "Block"}})
    assert config.stage3.unit_classes == ("Block",)
    assert [u.name for u in find_units(tiny(), replace(config.stage3, persistence_threshold=0))] == ["<root>", "blocks.0", "blocks.1"]


def test_class_objects_match_instances_and_subclasses() -> None:
    class WiderBlock(Block):
        pass

    model = tiny()
    model.blocks[1] = WiderBlock(model.config)
    assert [u.name for u in find_units(model, Stage3Policy(persistence_threshold=0, units=Block))] == ["<root>", "blocks.0", "blocks.1"]
    assert [u.name for u in find_units(model, Stage3Policy(persistence_threshold=0, unit_classes=("Block",)))] == ["<root>", "blocks.0"]


def test_module_instances_make_units() -> None:
    model = tiny()
    units = find_units(model, Stage3Policy(persistence_threshold=0, units=(model.blocks[1].mlp, model.blocks[0])))
    assert [(u.name, u.parent) for u in units] == [("<root>", None), ("blocks.0", 0), ("blocks.1.mlp", 0)]
    owner = owners(model, units)
    assert owner["blocks.1.mlp.2.bias"] == "blocks.1.mlp"
    assert owner["blocks.1.attn.qkv.weight"] == "<root>"  # its Block is no unit


def test_nested_units_own_what_the_units_inside_them_do_not() -> None:
    model = tiny()
    units = find_units(model, Stage3Policy(persistence_threshold=0, unit_classes=("Block",), units=(CausalSelfAttention,)))
    assert [(u.name, u.parent) for u in units] == [
        ("<root>", None), ("blocks.0", 0), ("blocks.0.attn", 1), ("blocks.1", 0), ("blocks.1.attn", 3)]
    owner = owners(model, units)
    assert owner["blocks.0.attn.qkv.weight"] == owner["blocks.0.attn.proj.bias"] == "blocks.0.attn"
    assert owner["blocks.0.ln_1.weight"] == owner["blocks.0.mlp.2.weight"] == "blocks.0"


def test_auto_wrap_does_not_nest() -> None:
    model = tiny()
    units = find_units(model, Stage3Policy(persistence_threshold=0, min_unit_params=1000))
    assert [u.name for u in units] == ["<root>", "blocks.0", "blocks.1"]


def test_a_weight_tied_between_sibling_units_goes_to_the_root() -> None:
    model = Pair()
    model.second.own.weight = model.first.own.weight
    model.second.inner.linear.bias = model.first.inner.linear.bias
    owner = owners(model, find_units(model, Stage3Policy(persistence_threshold=0, units=(Outer, Inner))))
    assert owner["first.own.weight"] == owner["second.own.weight"] == "<root>"
    assert owner["first.inner.linear.bias"] == owner["second.inner.linear.bias"] == "<root>"
    assert owner["first.own.bias"] == "first" and owner["second.inner.linear.weight"] == "second.inner"


def test_a_weight_an_outer_unit_shares_with_a_unit_inside_it_goes_to_the_outer_one() -> None:
    model = Pair()
    model.first.own.weight = model.first.inner.linear.weight
    model.head.weight = model.second.inner.linear.weight  # the root's own code shares it: the root's
    owner = owners(model, find_units(model, Stage3Policy(persistence_threshold=0, units=(Outer, Inner))))
    assert owner["first.own.weight"] == owner["first.inner.linear.weight"] == "first"
    assert owner["first.inner.linear.bias"] == "first.inner"
    assert owner["head.weight"] == owner["second.inner.linear.weight"] == "<root>"


def test_what_matches_nothing_raises_one_line_naming_what_was_given() -> None:
    model = tiny()
    stranger = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="matched no module") as error:
        find_units(model, Stage3Policy(persistence_threshold=0, unit_classes=("Block", "Blok"), units=(Inner, stranger)))
    message = str(error.value)
    assert "\n" not in message
    assert "'Blok'" in message and "Inner" in message and "<Linear instance>" in message and "'Block'" in message


@pytest.mark.parametrize("policy,match", [
    ({"unit_classes": (Block,)}, "unit_classes entry .* is not a class name"),
    ({"unit_classes": ("",)}, "unit_classes entry '' is not a class name"),
    ({"units": ("Block",)}, "units entry 'Block' is neither an nn.Module class nor a module instance"),
])
def test_policy_rejects_entries_of_the_wrong_kind(policy: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Stage3Policy(**policy)


def test_json_unit_classes_must_be_names() -> None:
    with pytest.raises(ValueError, match="must be a module class name or a list of them"):
        from_dict({"zero_optimization": {"stage": 3, "stage3_unit_classes": ["Block", 3]}})


def test_parameters_under_the_persistence_threshold_stay_with_the_root() -> None:
    """DeepSpeed's stage3_param_persistence_threshold is per parameter: norms and biases (24 elements
    here) are gathered with the root once a step; the blocks keep their matrices."""
    model = tiny()
    owner = owners(model, find_units(model, Stage3Policy(unit_classes=("Block",), persistence_threshold=100)))
    assert owner["blocks.0.ln_1.weight"] == owner["blocks.1.mlp.0.bias"] == "<root>"
    assert owner["blocks.0.mlp.0.weight"] == "blocks.0" and owner["blocks.1.attn.qkv.weight"] == "blocks.1"
