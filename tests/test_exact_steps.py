"""Which optimizers zerokit accepts and how it shards them (issue 9); that each step equals one process's is
tested in test_parity.py (the idle-branch, moe-idle-experts, muon-adamw, adafactor and sgd cases)."""

from __future__ import annotations

import pytest
import torch

import zerokit
from zerokit.config.typed import ZeroConfig
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss


class Lion(torch.optim.SGD):
    """A stand-in for a third-party optimizer: its own step(), so zerokit cannot know what it does."""

    def step(self, closure=None):
        return super().step(closure)


class DeclaredLion(Lion):
    zerokit_kind = "elementwise"


def train_one_step(optimizer_factory, config) -> zerokit.Engine:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    engine = zerokit.initialize(model, optimizer_factory(model), config)
    tokens = torch.randint(0, 67, (2, 17))
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
    assert engine.step().stepped
    return engine


def test_an_optimizer_zerokit_does_not_know_is_refused_in_one_line(one_process) -> None:
    with pytest.raises(ValueError) as error:
        train_one_step(lambda m: Lion(m.parameters(), lr=0.1), {"zero_optimization": {"stage": 1}})
    message = str(error.value)
    assert "\n" not in message
    assert "zerokit does not know whether Lion updates each element" in message
    assert "optimizer_kinds={Lion: 'elementwise' or 'whole_tensor'}" in message
    assert "zero_allow_untested_optimizer: true" in message


@pytest.mark.parametrize("how", ["class attribute", "typed config", "class name", "allow untested"])
def test_a_declared_optimizer_trains(one_process, how) -> None:
    factory, config = (lambda m: Lion(m.parameters(), lr=0.1)), {"zero_optimization": {"stage": 2}}
    if how == "class attribute":
        factory = lambda m: DeclaredLion(m.parameters(), lr=0.1)  # noqa: E731
    elif how == "typed config":
        config = ZeroConfig(stage=2, optimizer_kinds={Lion: "elementwise"})
    elif how == "class name":
        config = ZeroConfig(stage=2, optimizer_kinds={"Lion": "whole_tensor"})
    else:
        config = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    engine = train_one_step(factory, config)
    assert type(engine.optimizer).__name__ in ("Lion", "DeclaredLion")


def test_closure_optimizers_are_refused(one_process) -> None:
    with pytest.raises(ValueError, match="LBFGS calls a closure several times per step"):
        train_one_step(lambda m: torch.optim.LBFGS(m.parameters()), {"zero_optimization": {"stage": 0}})


def test_a_wrong_declared_kind_is_refused(one_process) -> None:
    with pytest.raises(ValueError, match="optimizer kind 'blockwise' for Lion is not one of elementwise, whole_tensor"):
        train_one_step(lambda m: Lion(m.parameters(), lr=0.1), ZeroConfig(stage=1, optimizer_kinds={Lion: "blockwise"}))


def test_two_optimizers_come_back_as_a_list_in_their_order(one_process) -> None:
    def muon_and_adamw(model):
        hidden = [p for name, p in model.named_parameters() if p.dim() == 2 and "blocks" in name]
        rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]

    engine = train_one_step(muon_and_adamw, {"zero_optimization": {"stage": 3, "stage3_min_unit_params": 1000}})
    assert [type(o).__name__ for o in engine.optimizer] == ["Muon", "AdamW"]
    muon_state = [state for state in engine.optimizer[0].state.values()]
    assert muon_state and all(s["momentum_buffer"].dim() == 2 for s in muon_state)  # Muon saw whole matrices


def test_whole_tensor_parameters_are_owned_and_moved_whole(parity_runs) -> None:
    """At stages 1-2 on 3 ranks, Muon's matrices sit in buckets each owned by one rank: each rank owns about a
    third of their elements, a step reduces each such bucket once and broadcasts it once from its owner (as
    many elements as a reduce-scatter and an all-gather of it), and the rest is sharded as before."""
    for stage in (1, 2):
        ranks = parity_runs(3)
        out = ranks[0][f"stage{stage}-fp32-muon-adamw"]
        owned = out["owned_buckets"]
        assert owned and {owner for owner, _ in owned} == {0, 1, 2}
        load = [sum(numel for owner, numel in owned if owner == rank) for rank in range(3)]
        assert max(load) - min(load) <= max(numel for _, numel in owned)  # greedy: within one bucket's size
        step = out["comm_per_step"][-1]
        owned_numel = sum(numel for _, numel in owned)
        assert step["broadcast"] == {"calls": len(owned), "elements": owned_numel, "bytes": 4 * owned_numel}
        assert step["all_gather"]["elements"] == out["layout_numel"] - owned_numel
