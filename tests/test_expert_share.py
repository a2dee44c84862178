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
                                         r"shards experts over one expert degree: give every layer the same ep_size "
                                         r"\(and expert_parallel.autoep_size\)$"):
        expert_degree(model)
    with pytest.raises(ValueError, match=r"split their experts over \[2, 4\] ranks"):
        expert_degree(nn.Sequential(moe(2)), configured=4)
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


# --- a Hugging Face model's experts, split by the config's expert_parallel block (zerokit/parallel/experts/hf.py) ---
def hf_experts(experts: int = 4, family: str = "mixtral") -> nn.Module:
    if family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssExperts
        return GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=12, num_local_experts=experts))
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralExperts
    return MixtralExperts(MixtralConfig(hidden_size=8, intermediate_size=12, num_local_experts=experts))


def split_with(model: nn.Module, degree: int = 2):
    from zerokit.config.settings import TensorSettings
    from zerokit.parallel.experts.hf import split_hf_experts
    part = TensorSettings(autotp_size=0, expert_parallel_size=degree, ranks_per_node=None,
                          launcher_ranks_per_node=None, timeout_seconds=60)
    return split_hf_experts(model, Layout(data=4, expert=degree), part, None, None)


@pytest.mark.parametrize("model, message", [
    (lambda: nn.Linear(4, 4), r"^expert_parallel.autoep_size=2, but Linear has no transformers MoE experts module"),
    (lambda: nn.ModuleDict({"experts": hf_experts(family="gpt_oss")}),
     r"^GptOssExperts's experts are not the Mixtral/Qwen-MoE layout .*; train it without expert_parallel"),
    (lambda: nn.ModuleDict({"experts": hf_experts(experts=3)}),
     r"^MixtralExperts has 3 experts, which do not split over expert_parallel.autoep_size=2 ranks; use a divisor of 3$"),
])
def test_what_the_expert_parallel_block_cannot_split_is_one_line(model, message: str, monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 0)  # the split reads this rank's place only
    with pytest.raises(ValueError, match=message):
        split_with(model())


def test_a_hugging_face_experts_parameter_used_elsewhere_is_refused(monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 0)
    experts = hf_experts()
    model = nn.ModuleDict({"experts": experts, "tied": nn.Module()})
    model["tied"].weight = experts.down_proj
    with pytest.raises(ValueError, match=r"^tied\.weight is an MoE experts parameter used outside its experts module"):
        split_with(model)


def test_a_rank_keeps_its_experts_and_the_optimizer_names_them(monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 3)  # place 1 of expert group [2, 3]
    from zerokit.config.settings import TensorSettings
    from zerokit.parallel.experts.hf import split_hf_experts
    experts = hf_experts()
    torch.nn.init.normal_(experts.gate_up_proj)
    model = nn.ModuleDict({"experts": experts, "norm": nn.LayerNorm(8)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    part = TensorSettings(autotp_size=0, expert_parallel_size=2, ranks_per_node=None, launcher_ranks_per_node=None,
                          timeout_seconds=60)
    split_hf_experts(model, Layout(data=4, expert=2), part, optimizer, None)
    split = model["experts"]
    assert (split.first_expert, len(split.experts)) == (2, 2)
    assert torch.equal(split.experts[1].gate_up_proj, experts.gate_up_proj[3])
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
