"""Stage 3's frozen parameters: sharded by unit like the trainable ones, with nothing else to do.

[Note: frozen parameters at stage 3]
A frozen parameter (requires_grad=False) gets no gradient, no optimizer state and no reduction, but at
stage 3 it must not stay whole on every rank either: in a LoRA-style fine-tune the frozen base model
is nearly all of the weights. So each unit's frozen parameters are packed into one 1-D buffer in the
compute dtype, padded to a multiple of N, and each rank keeps only its 1/N shard. The buffer is
all-gathered and freed together with the unit's trainable buckets (same gather process group, same
live-element count), and a released frozen parameter gets the same NaN placeholder a trainable one
does. Nothing ever updates the shard except in-place edits kept by engine.unsharded(write_back=True).

Freeing in backward needs one more signal than a trainable unit does. A trainable unit is freed once
all its gradients are launched: a gradient is complete only after its parameter's last backward use.
A frozen weight has no gradient to tell us that, and its last backward use may come after every
trainable gradient of its unit is in (a frozen LayerNorm in front of trainable adapters: its backward,
which reads its weight, runs last in the unit). A frozen weight's backward is needed only to carry
gradients further back, towards the unit's inputs (a path to a trainable parameter of the same unit
ends in that parameter's gradient, which is waited for anyway). So a unit with frozen parameters is
freed in backward once its trainable gradients are all launched *and* the gradients of its forward
inputs that require grad are complete (tensor hooks registered in its pre-forward). Inputs that never
get a gradient leave the unit gathered until the end of backward, which frees every unit anyway.

Frozen parameters that are not floating point (integer codes, say) are left whole, as the cast to the
compute dtype leaves them at every stage.
"""

from __future__ import annotations

import torch
from torch import nn

from zerokit.comm import Communicator, Pending, wait
from zerokit.flat.layout import round_up


class FrozenShards:
    """One unit's frozen parameters: this rank's shard always, the full buffer only while gathered."""

    def __init__(self, params: list[nn.Parameter], rank: int, world_size: int, dtype: torch.dtype) -> None:
        if not params:
            raise ValueError("FrozenShards needs at least one frozen parameter")
        self.params = params
        self.rank = rank
        self.numel = round_up(sum(p.numel() for p in params), world_size)  # padded, the gathered size
        self.shard_numel = self.numel // world_size
        device = params[0].device
        self.shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)  # 1-D, this rank's slice
        self.full: torch.Tensor | None = None  # 1-D, the whole padded buffer, while gathered
        self.in_flight: Pending | None = None

    def pack(self) -> torch.Tensor:
        """Keep this rank's slice of the parameters' current values; returns all of them packed (1-D,
        fp32, padded: for the cross-rank check) so that the caller can let the full values go."""
        values = torch.zeros(self.numel, dtype=torch.float32, device=self.shard.device)
        offset = 0
        for param in self.params:
            values[offset:offset + param.numel()].copy_(param.data.reshape(-1))
            offset += param.numel()
        self.shard.copy_(values[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel])
        return values

    @property
    def gathered(self) -> bool:
        """Gathered or being gathered: the full buffer exists."""
        return self.full is not None

    @property
    def ready(self) -> bool:
        return self.full is not None and self.in_flight is None

    def gather(self, comm: Communicator) -> None:
        """Start gathering the full buffer (asynchronously); `wait()` before using the parameters."""
        self.full = torch.empty(self.numel, dtype=self.shard.dtype, device=self.shard.device)
        self.in_flight = comm.all_gather(self.full, self.shard, async_op=True)

    def wait(self) -> None:
        if self.in_flight is not None:
            wait(self.in_flight)
            self.in_flight = None

    def point(self) -> None:
        """Make every parameter a view of the gathered buffer (See [Note: flat buffer aliasing])."""
        if self.full is None:
            raise RuntimeError(f"rank {self.rank}: frozen parameters pointed at before they were gathered")
        offset = 0
        for param in self.params:
            param.data = self.full[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()

    def free(self) -> int:
        """Drop the full buffer (once any gather into it is done); returns how many elements were freed.
        The parameters still view it until `release_params`."""
        self.wait()
        freed = self.numel if self.full is not None else 0
        self.full = None
        return freed

    def release_params(self, placeholder: torch.Tensor) -> None:
        """Every parameter becomes `placeholder` broadcast to its shape (See ShardedParameters._release_params)."""
        for param in self.params:
            param.data = placeholder.expand(param.shape)

    def write_back(self) -> None:
        """Keep in-place edits made to the gathered parameters: this rank's slice goes back to the shard."""
        if self.ready:
            self.shard.copy_(self.full[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel])

    def tensors(self) -> list[torch.Tensor]:
        """What this holds in memory: the shard, and the full buffer while gathered."""
        return [self.shard] if self.full is None else [self.shard, self.full]
