"""Module buffers kept equal on every rank (`broadcast_buffers`, default true), as torch DDP keeps them.

[Note: buffers kept in step]
Parameters are the same on every rank by construction; buffers are not. BatchNorm's running statistics are
updated from each rank's own batch, so after one training forward they differ per rank, and so do eval outputs
and a saved `full_state_dict()` depending on which rank is asked. DDP's answer, kept here: before a forward
that follows a forward with autograd enabled (and before the first), every rank's buffers become rank 0's, in
one broadcast per buffer dtype (the buffers are packed into one flat tensor each), counted in comm_stats() as
broadcasts. zerokit also does it in `engine.step()` if a forward has run since, so that the buffers are equal
between steps too (full_state_dict(), checkpoints); the next forward then has nothing to do, so a training step
still costs one broadcast per dtype. A model without buffers costs nothing. `broadcast_buffers: false` leaves
each rank's buffers its own (a model whose buffers are constants, or a user who averages them himself).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerokit.comm import Communicator

PURPOSE = "module buffers (broadcast_buffers)"


def buffer_groups(model: nn.Module) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    """The model's buffers as they are broadcast: one flat tensor per (dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in model.buffers():
        groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    return groups


class BufferSync:
    def __init__(self, model: nn.Module, comm: Communicator, enabled: bool) -> None:
        self.comm = comm
        self.groups = buffer_groups(model) if enabled and comm.world_size > 1 else {}
        self.stale = True  # DDP also syncs before the first forward
        self.handles: list[RemovableHandle] = []
        if self.groups:
            pre, post = torch.compiler.disable(self._pre_forward), torch.compiler.disable(self._post_forward)
            self.handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.sync()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.stale = self.stale or torch.is_grad_enabled()

    def sync(self) -> None:
        """Every rank's buffers become rank 0's, if a forward may have changed them since the last sync."""
        if not self.stale:
            return
        self.stale = False
        with torch.no_grad():
            for group in self.groups.values():
                flat = torch.cat([buffer.reshape(-1) for buffer in group])
                self.comm.broadcast(flat, src=0, purpose=PURPOSE)
                if self.comm.rank != 0:
                    for buffer, values in zip(group, flat.split([buffer.numel() for buffer in group])):
                        buffer.copy_(values.view_as(buffer))
