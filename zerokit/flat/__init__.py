"""Flat buffers and their shard arithmetic. layout.py is pure arithmetic, which the planner calls as the engine
does, so names are imported on first use: importing zerokit.flat.layout does not import torch."""

from zerokit._support.lazy import lazy_names

_LAZY = {
    **dict.fromkeys(["FlatParameters", "bucket_view", "copy_edits", "own_part", "shard_view",
                     "tensor_bytes"], "zerokit.flat.buffers"),
    **dict.fromkeys(["Bucket", "FlatLayout", "ParamEntry", "ParamSlice", "RankShards", "Slot", "assign_owners",
                     "build_layout"], "zerokit.flat.layout"),
    **dict.fromkeys(["ShardedFlat", "gather_bucket"], "zerokit.flat.sharded"),
}
__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY, globals())
