"""Loss scaling, the global gradient norm across shards, clipping: written once, used by every stage. The leaf math
(arithmetic.py: sums of squares, scaling, the clipping factor), the norm (norm.py: one scalar all-reduce decides
overflow and norm), the loss scaler (scaler.py) and the step's record (result.py). zerokit's modules import the
part they use; its names are re-exported here."""

from zerokit.precision.arithmetic import (CPU_NORM_CHUNK_NUMEL_PER_THREAD, CUDA_NORM_CHUNK_NUMEL, by_device,
                                          clip_coefficient, device_square_sum, norm_chunk_numel, scale_, square_sum,
                                          unscale_, unscaled_square_sum)
from zerokit.precision.norm import global_grad_norm, global_norm
from zerokit.precision.result import StepResult
from zerokit.precision.scaler import DynamicLossScaler, NoLossScaler, make_loss_scaler

__all__ = ["CPU_NORM_CHUNK_NUMEL_PER_THREAD", "CUDA_NORM_CHUNK_NUMEL", "DynamicLossScaler", "NoLossScaler",
           "StepResult", "by_device", "clip_coefficient", "device_square_sum", "global_grad_norm", "global_norm",
           "make_loss_scaler", "norm_chunk_numel", "scale_", "square_sum", "unscale_", "unscaled_square_sum"]
