from zerokit.flat.buffers import FlatParameters, bucket_view, shard_view
from zerokit.flat.layout import Bucket, FlatLayout, Slot, build_layout

__all__ = ["Bucket", "FlatLayout", "FlatParameters", "Slot", "build_layout", "bucket_view", "shard_view"]
