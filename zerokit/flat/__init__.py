from zerokit.flat.buffers import FlatParameters, bucket_view, own_part, shard_view, tensor_bytes
from zerokit.flat.layout import Bucket, FlatLayout, ParamEntry, ParamSlice, RankShards, Slot, assign_owners, build_layout
from zerokit.flat.sharded import ShardedFlat, gather_bucket

__all__ = ["Bucket", "FlatLayout", "FlatParameters", "ParamEntry", "ParamSlice", "RankShards", "ShardedFlat", "gather_bucket", "Slot", "assign_owners", "build_layout",
           "bucket_view", "own_part", "shard_view", "tensor_bytes"]
