"""Where one fp32 master lives, and what moving its gradient in and its values out costs.

[Note: masters that alias the compute shard]
In fp32 training the master and the compute parameter would hold the same numbers, so where the compute
shard is fp32 and lives where the master should, the master *is* the compute shard (a view of the flat
buffer, or of stage 3's shard buffer): the optimizer updates the parameters in place and publishing
copies nothing. A 16-bit compute dtype, or a master on another tier, gets its own fp32 tensor.

[Note: the host tier on a machine without a GPU]
The host tier keeps its masters, their optimizer state and a gradient buffer in host memory, apart from
the compute shards, and moves each gradient in and each update out even when the "device" is the CPU
itself: nothing is saved there, but the path that runs is the one a GPU machine runs (counted in
comm_stats() as host_to_device and device_to_host), so the tests exercise it. With CUDA the buffers are
pinned and the copies asynchronous: a gradient shard's copy is started as soon as its bucket is
reduced and waited for only at the optimizer step.

[Note: squares taken before the gradient leaves the device]
The global norm needs every gradient element's square. A master in host memory would have them summed there, at
the step: a pass over its whole fp32 gradient in host memory, 18 GB for a 4.5B-parameter model, on the CPU, after
the last copy. So the host tier sums its shard's squares (float64, See [Note: the float64 sum of squares in chunks]
in zerokit/precision/arithmetic.py) as it accepts the shard, on the device, while backward goes on, as DeepSpeed's
offload takes its partitions' norms on the GPU before moving them; the step adds those sums (unscaled by the loss
scale's square) and reads no host gradient for the norm. Without CUDA the same sum is taken on the CPU at the same
moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from zerokit.comm import CommStats, Transfer
from zerokit.flat.buffers import copy_edits
from zerokit.precision.arithmetic import device_square_sum
from zerokit.tiers.copies import copy_to_host
from zerokit.tiers.pinned import host_buffer

if TYPE_CHECKING:
    from zerokit.tiers.swap import SwapDirectory


class Home(Protocol):
    """Where one fp32 master lives: what ShardMasters and a checkpoint see of any tier."""

    tier: str
    """device | host | nvme"""
    master: torch.Tensor
    paged: bool
    """The master lives in swap files and comes into memory only for its own step (See tiers/nvme_masters.py)."""
    swap: "SwapDirectory | None"
    """The swap files of a paged master; None elsewhere."""
    copies_grad: bool
    """accept_grad copies the gradient into memory of its own (the host tier): the stage may let go of its tensor."""

    def initialise(self, values: torch.Tensor) -> None: ...
    def accept_grad(self, grad: torch.Tensor) -> None: ...
    def grad32(self) -> torch.Tensor: ...
    def squares(self) -> torch.Tensor | None:
        """The accepted gradient's float64 sum of squares, taken before it left the device, or None: read the gradient
        at the step (See [Note: squares taken before the gradient leaves the device])."""
    def release(self) -> None: ...
    def publish(self) -> None: ...
    def write_back(self) -> None: ...
    def held(self) -> dict[str, int]: ...


class ShardIO(Protocol):
    """The home of a compute shard (zerokit/tiers/shards.py): writes into it and reads from it, counting
    what crosses between tiers."""

    tier: str
    swap: "SwapDirectory | None"
    """The swap files of shards on NVMe; None elsewhere."""

    def write(self, shard: torch.Tensor, values: torch.Tensor, source: str) -> None: ...
    def read(self, shard: torch.Tensor, target: str) -> torch.Tensor: ...


class HeldGradient:
    """A master's reduced gradient shard, kept where it was reduced until the step; its fp32 form is made once
    (a transient copy only when the shard is 16-bit) and may be changed in place by the step."""

    _grad: torch.Tensor | None = None
    _grad32: torch.Tensor | None = None
    copies_grad = False  # it holds the stage's tensor until the step

    def accept_grad(self, grad: torch.Tensor) -> None:
        self._grad, self._grad32 = grad, None

    def grad32(self) -> torch.Tensor:
        if self._grad32 is None:
            if self._grad is None:
                raise RuntimeError("a master got no gradient before the optimizer step (an internal bug)")
            self._grad32 = self._grad if self._grad.dtype == torch.float32 else self._grad.float()
        return self._grad32

    def squares(self) -> None:
        return None  # the gradient is where the step reads it

    def release(self) -> None:
        self._grad = self._grad32 = None


class DeviceHome(HeldGradient):
    """The default tier: the master on the device the model computes on. `io`: the compute shard's home."""

    tier, paged, swap = "device", False, None

    def __init__(self, compute: torch.Tensor, device: torch.device, io: ShardIO, param_dtype: torch.dtype) -> None:
        """`compute`: the shard it publishes to; `param_dtype`: the dtype the model computes in (stage 3 keeps its
        shards in fp32 under a 16-bit one: See [Note: the shard is the fp32 master] in zerokit/flat/sharded.py)."""
        self.compute, self.io = compute, io
        self.aliased = compute.dtype == torch.float32 and io.tier == "device"
        self.master = compute if self.aliased else torch.empty(compute.numel(), device=device)
        self.is_parameter = self.aliased and param_dtype == torch.float32  # fp32 training: counted as parameters

    def initialise(self, values: torch.Tensor) -> None:
        if not self.aliased:  # an aliased master already holds them: its compute shard was filled first
            self.master.copy_(values)

    def publish(self) -> None:
        if not self.aliased:
            self.io.write(self.compute, self.master, self.tier)

    def write_back(self) -> None:
        if not self.aliased:
            copy_edits(self.master, self.io.read(self.compute, self.tier))

    def held(self) -> dict[str, int]:
        """Bytes it holds by category, besides the optimizer's state: the master unless it is the parameter."""
        return {"optimizer_state": 0 if self.is_parameter else _bytes(self.master)}


class HostHome:
    """The CPU tier (offload_optimizer.device=cpu): master and gradient in host memory, stepped on the CPU.
    See [Note: the host tier on a machine without a GPU]."""

    tier, paged, swap = "host", False, None
    copies_grad = True  # accept_grad keeps a copy of its own: the stage may let go of the device's

    def __init__(self, compute: torch.Tensor, pin_memory: bool, stats: CommStats, io: ShardIO) -> None:
        pin = pin_memory and torch.cuda.is_available()  # page-locking needs the CUDA driver
        self.compute, self.stats, self.io = compute, stats, io
        self.crosses = io.tier == "device"  # publishing crosses to the device (not so for offloaded params)
        self.master = host_buffer(compute.numel(), pin=pin)  # See [Note: pinned memory of the size asked for]
        self.grad = host_buffer(compute.numel(), pin=pin, zeroed=True)
        # a 16-bit copy to send, so that half the bytes cross the bus (cast on the host, as DeepSpeed does)
        self.staging = (host_buffer(compute.numel(), dtype=compute.dtype, pin=pin)
                        if self.crosses and compute.is_cuda and compute.dtype != torch.float32 else None)
        self._copied: torch.cuda.Event | None = None
        self._squares: torch.Tensor | None = None
        self._has_grad = False

    def initialise(self, values: torch.Tensor) -> None:
        self.master.copy_(values)

    def accept_grad(self, grad: torch.Tensor) -> None:
        """Start copying the reduced shard into the host buffer; the caller may let go of `grad` at once (See [Note: a
        gradient's copy to the host] in zerokit/tiers/copies.py), its squares summed first (See [Note: squares taken
        before the gradient leaves the device])."""
        self._squares = device_square_sum([grad])
        self._copied = copy_to_host(self.grad, grad)
        self.stats.record(Transfer.DEVICE_TO_HOST, grad)
        self._has_grad = True

    def grad32(self) -> torch.Tensor:
        if not self._has_grad:
            raise RuntimeError("a master got no gradient before the optimizer step (an internal bug)")
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self.grad

    def squares(self) -> torch.Tensor | None:
        return self._squares

    def release(self) -> None:
        self._has_grad, self._squares = False, None

    def publish(self) -> None:
        source = self.master
        if self.staging is not None:
            self.staging.copy_(self.master)
            source = self.staging
        self.io.write(self.compute, source, self.tier)

    def write_back(self) -> None:
        copy_edits(self.master, self.io.read(self.compute, self.tier))

    def held(self) -> dict[str, int]:
        return {"optimizer_state": _bytes(self.master), "gradients": _bytes(self.grad),
                "parameters": _bytes(self.staging) if self.staging is not None else 0}


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


