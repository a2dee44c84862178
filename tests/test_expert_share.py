"""The engine's expert room (zerokit/parallel/experts/share.py): bad input around experts split over ranks is one line
that names what is wrong and what is accepted, found before any collective. The training itself is checked against one
process in tests/test_deepspeed_moe.py (2 x 2 and 4 x 1 ranks, ZeRO 0-2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerokit.parallel.experts.layer import ExpertParallelMoE
from zerokit.parallel.experts.share import _refuse_shared, expert_degree, expert_layout, refuse_with_experts
from zerokit.parallel.mesh import Layout

HIDDEN = 8


def moe(ep: int, experts: int = 4) -> ExpertParallelMoE:
    return ExpertParallelMoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=experts, ep_size=ep)


def test_layers_that_split_their_experts_differently_are_refused() -> None:
    model = nn.Sequential(moe(2), moe(4))
    with pytest.raises(ValueError, match=r"^the model's MoE layers split their experts over \[2, 4\] ranks; zerokit "
                                         r"shards experts over one expert degree: give every layer the same ep_size$"):
        expert_degree(model)
    assert expert_degree(nn.Sequential(moe(1), nn.Linear(2, 2))) == 1 and expert_degree(nn.Linear(2, 2)) == 1


@pytest.mark.parametrize("layout,wrong", [(Layout(data=2, tensor=2), "tensor 2"),
                                          (Layout(data=2, sequence=2), "sequence 2"),
                                          (Layout(data=2, pipeline=2), "pipeline 2")])
def test_experts_beside_another_degree_are_refused(layout: Layout, wrong: str) -> None:
    with pytest.raises(ValueError, match=r"^MoE layers with experts split over 2 ranks beside pipeline .*; accepted: an "
                                         r"expert degree inside a data-parallel job$") as raised:
        expert_layout(layout, moe(2))
    assert wrong in str(raised.value)


def test_a_layout_whose_expert_degree_differs_from_the_layers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^the layout's expert degree 4 differs from the 2 ranks the model's MoE layers "
                                         r"split their experts over; give the layers ep_size equal to the layout's$"):
        expert_layout(Layout(data=4, expert=4), moe(2))
    assert expert_layout(None, moe(1)) is None  # nothing split: the layout as it is


def test_an_expert_used_outside_its_layer_is_refused_by_name() -> None:
    layer = moe(2)
    model = nn.ModuleDict({"moe": layer, "shortcut": layer.experts[1]})
    params = {id(param) for param in layer.experts.parameters()}
    with pytest.raises(ValueError, match=r"^shortcut\.weight is an MoE expert's parameter used outside its MoE layer; "
                                         r"an expert split over ranks must be its layer's alone"):
        _refuse_shared(model, params)
    _refuse_shared(nn.ModuleDict({"moe": layer}), params)  # its own names only: accepted


@pytest.mark.parametrize("mics,nvme,meta,message", [
    (True, False, False, r"^zero_optimization\.mics_shard_size with MoE experts split over ranks \(ep_size > 1\) is "
                         r"not offered yet; drop the key, or use ep_size=1$"),
    (False, True, False, r"^offload to nvme with MoE experts split over ranks \(ep_size > 1\) is not offered yet; "
                         r"accepted: offload to cpu, or none$"),
    (False, False, True, r"^a model built on the meta device with MoE experts split over ranks \(ep_size > 1\) is not "
                         r"offered yet; build it on the CPU")])
def test_what_split_experts_do_not_do_yet_is_one_line(mics: bool, nvme: bool, meta: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        refuse_with_experts(mics, nvme, meta)
    refuse_with_experts(False, False, False)


def test_a_layer_without_its_expert_group_says_how_to_get_one() -> None:
    layer = moe(2)
    assert layer.num_local_experts == 2 and len(layer.experts) == 2  # the ranks' share, before any group
    with pytest.raises(RuntimeError, match=r"^this MoE layer splits its experts over 2 ranks but has no expert group "
                                           r"yet: wrap the model with zerokit\.initialize \(or deepspeed\.initialize\)"):
        layer(torch.zeros(3, HIDDEN))
