"""Tensor parallelism inside a node, ZeRO across the replicas: the split layers (layers.py), AutoTP's plan for a
Hugging Face model (autotp.py), and what the optimizer step needs of the tensor group (share.py). Which ranks form a
tensor group is zerokit/parallel/mesh.py's."""

from zerokit.parallel.tensor.autotp import Split, hf_plan, planned_splits, split_model
from zerokit.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, split_parameters
from zerokit.parallel.tensor.share import TensorShare

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "Split", "TensorShare", "hf_plan", "planned_splits",
           "split_model", "split_parameters"]
