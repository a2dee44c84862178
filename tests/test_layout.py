"""Shard arithmetic, checked as properties over random models and world sizes (no processes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from zerokit.flat.layout import build_layout

params_strategy = st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 2)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(params=params_strategy, world_size=st.integers(1, 1024), bucket_numel=st.integers(1, 20000))
def test_layout_invariants(params, world_size, bucket_numel) -> None:
    layout = build_layout(params, world_size, bucket_numel)
    placed = sorted(slot.param_index for bucket in layout.buckets for slot in bucket.slots)
    assert placed == list(range(len(params)))  # every parameter exactly once
    start = 0
    for position, bucket in enumerate(layout.buckets):
        assert bucket.index == position and bucket.start == start  # buckets tile the buffer
        assert bucket.numel % world_size == 0  # ...and divide by N, padding included
        offset = bucket.start
        for slot in bucket.slots:  # parameters tile the bucket, in backward order
            assert slot.offset == offset and slot.numel == params[slot.param_index][0]
            assert params[slot.param_index][1] == bucket.group  # one optimizer group per bucket
            offset += slot.numel
        assert 0 <= bucket.end - offset < world_size  # padding below N
        shards = [bucket.shard_range(rank) for rank in range(world_size)]
        assert shards[0][0] == bucket.start and shards[-1][1] == bucket.end
        assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))  # shards tile the bucket
        start = bucket.end
    assert layout.numel == start and layout.shard_numel * world_size == layout.numel
    assert layout.data_numel == sum(numel for numel, _ in params)
    # launch order: the order in which each bucket's last parameter arrives in backward
    completions = [max(slot.param_index for slot in bucket.slots) for bucket in layout.buckets]
    assert completions == sorted(completions)


def test_buckets_close_at_the_size_limit() -> None:
    layout = build_layout([(100, 0)] * 10, world_size=3, bucket_numel=250)
    assert [len(b.slots) for b in layout.buckets] == [3, 3, 3, 1]
    assert [b.numel for b in layout.buckets] == [300, 300, 300, 102]  # 100 padded to 102 = 3 x 34


def test_groups_never_share_a_bucket() -> None:
    layout = build_layout([(10, 0), (1, 1), (10, 0), (1, 1)], world_size=2, bucket_numel=1000)
    assert sorted((b.group, [s.param_index for s in b.slots]) for b in layout.buckets) == [(0, [0, 2]), (1, [1, 3])]
