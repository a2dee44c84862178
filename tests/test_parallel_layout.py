"""The pipeline x data x tensor layout (zerokit/parallel/mesh.py): its rank arithmetic against torch's DeviceMesh and
DeepSpeed's topology order, its errors, and an engine that shards over its data group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zerokit
from zerokit.parallel.mesh import Layout
from zerokit.testing.models import TinyGPT, TinyGPTConfig, lm_loss, rank_batch, small_zero_config
from zerokit.testing.spawn import spawn


@settings(max_examples=100, deadline=None)
@given(pipeline=st.integers(1, 4), data=st.integers(1, 5), tensor=st.integers(1, 4))
def test_every_dimension_partitions_the_ranks(pipeline, data, tensor) -> None:
    layout = Layout.resolve(pipeline * data * tensor, pipeline=pipeline, tensor=tensor)
    assert layout == Layout(pipeline, data, tensor)
    for groups, size in ((layout.data_groups(), data), (layout.pipeline_groups(), pipeline),
                         (layout.tensor_groups(), tensor)):
        assert sorted(rank for group in groups for rank in group) == list(range(layout.world_size))
        assert all(len(group) == size for group in groups)
    for rank in range(layout.world_size):
        assert layout.rank_of(*layout.coordinates(rank)) == rank
        stage, replica, tensor_index = layout.coordinates(rank)
        # DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model): the model axis innermost
        assert rank == (stage * data + replica) * tensor + tensor_index
    assert all(group == list(range(group[0], group[0] + tensor)) for group in layout.tensor_groups())


@settings(max_examples=100, deadline=None)
@given(pipeline=st.integers(1, 3), blocks=st.integers(1, 3), expert=st.integers(1, 4), sequence=st.integers(1, 2),
       tensor=st.integers(1, 3))
def test_the_expert_groups_split_the_data_groups(pipeline, blocks, expert, sequence, tensor) -> None:
    """Every expert group is `expert` replicas of one data group, every expert-data group the ranks of one data group
    at one place in the blocks; an expert group and an expert-data group meet in exactly one replica."""
    data = blocks * expert
    layout = Layout.resolve(pipeline * data * sequence * tensor, pipeline=pipeline, tensor=tensor, sequence=sequence,
                            expert=expert)
    experts, holders = layout.expert_groups(), layout.expert_data_groups()
    for groups, size in ((experts, expert), (holders, blocks * sequence)):
        assert sorted(rank for group in groups for rank in group) == list(range(layout.world_size))
        assert all(len(group) == size for group in groups)
    for group in experts + holders:
        assert any(set(group) <= set(data_group) for data_group in layout.data_groups())
    for group in experts:
        assert sum(len(set(group) & set(holder)) for holder in holders) == expert


def test_the_expert_groups_are_deepspeeds() -> None:
    """deepspeed.utils.groups' order: without tensor parallelism, expert groups of consecutive ranks and expert-data
    groups strided ("expert before data"); with it, the same over each tensor index's data ranks (mpu groups)."""
    plain = Layout.resolve(4, expert=2)
    assert plain.expert_groups() == [[0, 1], [2, 3]] and plain.expert_data_groups() == [[0, 2], [1, 3]]
    tensor = Layout.resolve(8, tensor=2, expert=2)
    assert tensor.expert_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert tensor.expert_data_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]


@pytest.mark.parametrize("world, degrees, ranks_per_node, message", [
    (6, {"pipeline": 4}, None, "6 ranks do not split into 4 pipeline stage(s) x 1 tensor rank(s)"),
    (6, {"expert": 4}, None, "an expert degree of 4 does not divide the 6 data replica(s) of 6 ranks"),
    (8, {"tensor": 4}, 2, "a tensor degree of 4 does not divide the 2 ranks of a node"),
    (4, {"pipeline": 0}, None, "the pipeline degree must be a positive integer, got 0"),
])
def test_a_layout_that_does_not_fit_is_refused_in_one_line(world, degrees, ranks_per_node, message) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        Layout.resolve(world, ranks_per_node=ranks_per_node, **degrees)


def _two_pipelines_of_data(rank: int, world_size: int) -> dict:
    """4 ranks as 2 stages x 2 replicas: every stage's engine trains the same model on its replicas' batches
    (what a pipeline stage's engine sees of the data dimension), sharded over its data group only."""
    layout = Layout.resolve(world_size, pipeline=2)
    stage, replica, _ = layout.coordinates(rank)
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), small_zero_config(3),
                                layout=layout)
    for step in range(3):
        loss = lm_loss(engine(rank_batch(replica, step)[:, :-1]), rank_batch(replica, step))
        engine.backward(loss)
        engine.step()
    mesh = layout.device_mesh("cpu")
    state = engine.full_state_dict()
    engine.close()
    return {"stage": stage, "data_ranks": engine.comm.world_size, "state": state, "mesh_coordinate": mesh.get_coordinate()}


def _one_group(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(n_layer=2))
    engine = zerokit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), small_zero_config(3))
    for step in range(3):
        engine.backward(lm_loss(engine(rank_batch(rank, step)[:, :-1]), rank_batch(rank, step)))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def test_an_engine_shards_over_its_data_group_only() -> None:
    """Each stage's 2 replicas train exactly as a 2-rank job of their own does (bit for bit: the same collectives
    on the same values), and the coordinates agree with torch's DeviceMesh of the same layout."""
    ranks = spawn(_two_pipelines_of_data, 4, timeout=240)
    alone = spawn(_one_group, 2, timeout=120)[0]
    layout = Layout.resolve(4, pipeline=2)
    for rank, result in enumerate(ranks):
        assert result["data_ranks"] == 2
        assert list(result["mesh_coordinate"]) == list(layout.coordinates(rank))
        for name, value in alone.items():
            torch.testing.assert_close(result["state"][name], value, rtol=0, atol=0)
