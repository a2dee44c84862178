from zerokit.flat.buffers import FlatParameters, bucket_view, local_view, own_part, shard_view, tensor_bytes
from zerokit.flat.layout import Bucket, FlatLayout, ParamEntry, Slot, build_layout
from zerokit.flat.sharded import ShardedFlat

__all__ = ["Bucket", "FlatLayout", "FlatParameters", "ParamEntry", "ShardedFlat", "Slot", "build_layout",
           "bucket_view", "local_view", "own_part", "shard_view", "tensor_bytes"]
