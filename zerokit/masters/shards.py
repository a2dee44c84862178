"""The fp32 master weights of the slices this rank updates, their gradients, and the user's optimizers
rebuilt over them: one owner, with a small interface a stage and the engine talk to (hand in a reduced
gradient shard, sum its squares, step, publish the updated values into the compute-dtype shards, count
bytes, save and load). Where each master lives is its home's business (zerokit/tiers/: homes.py, the device
and host memory; nvme_masters.py, files), so the same step runs on every tier.

[Note: optimizer pieces]
A master is one flat tensor per bucket (25 MiB by default), but the optimizer does not step it whole.
Each parameter's part of it is its own piece, so that a parameter no rank used can be skipped with its
own step count and state (See [Note: parameters no rank used] in stages/usage.py), and a whole-tensor
optimizer sees each parameter whole and shaped. Where the master lives in host memory and the optimizer
steps with torch's for-loop implementation (its CPU default), the pieces are also cut to at most 64K elements:
that implementation runs one element-wise op after another over each tensor, and over a tensor far larger than
the cache every op streams it from memory again; cache-sized pieces halve AdamW's step time on this 2-core
machine (77 ms -> 36 ms for 10.9M elements) and are exact, as these optimizers update each element from its own
gradient and state alone. A fused kernel (`fused=True`, what a config's `optimizer` block builds: See [Note:
fused optimizer kernels] in zerokit/engine/schedules.py) makes one pass over each element already, so cutting gains it
nothing and costs a kernel call and a thread-pool round per piece: over 150M host elements, torch's fused AdamW
stepped 2,288 pieces of 64K in 0.173 s and 100 whole parameters in 0.118 s (2 threads; a 4.5B-parameter model
is 69,000 pieces). So a fused optimizer's master, like one on a GPU, is cut only at parameter boundaries. The
piece size follows where the master lives and how its optimizer steps, not where the model computes.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import torch
from torch import nn

from zerokit.flat import ParamSlice, tensor_bytes
from zerokit.masters.optimizer import GroupRef, rebuild_optimizer
from zerokit.precision.arithmetic import scale_, square_sum, unscale_, unscaled_square_sum
from zerokit.config.settings import optimizer_piece_numel
from zerokit.tiers.homes import Home

TIERS = ("device", "host", "nvme")


def piece_numel(sub_group_size: int | None, device_type: str, fused: bool = False) -> int:
    """The most elements an optimizer piece of a master on `device_type` holds, under a fused kernel or not (the
    decision is the planner's too: zerokit/config/settings.py)."""
    return optimizer_piece_numel(sub_group_size, master_on_host=device_type == "cpu", fused=fused)


class PieceRef(NamedTuple):
    """One optimizer piece, for code that saves or loads per parameter (checkpoints): its values are
    `piece.data` (a view of the master) and its state `optimizer.state[piece]`."""

    param_index: int
    param_begin: int  # where the piece begins within the (flattened) parameter
    piece: nn.Parameter
    optimizer: torch.optim.Optimizer


@dataclass(frozen=True)
class OptimizerPlan:
    """The user's optimizers, and where each flattened param group of theirs comes from."""

    optimizers: tuple[torch.optim.Optimizer, ...]
    refs: tuple[GroupRef, ...]  # by flattened group index

    @property
    def names(self) -> list[str]:
        return [type(optimizer).__name__ for optimizer in self.optimizers]


def piece_size(home: Home, ref: GroupRef, sub_group_size: int | None) -> int:
    """The piece size of a master in `home` stepped by `ref`'s optimizer: a fused kernel's pieces are whole parameter
    parts, except on NVMe, whose records (runs of pieces) bound the host memory a paged step takes (See [Note: paging
    a master through a bounded pool] in zerokit/tiers/nvme_masters.py)."""
    return piece_numel(sub_group_size, home.master.device.type, fused=ref.fused and not home.paged)


class Piece(NamedTuple):
    param: nn.Parameter  # what the optimizer steps: a view of the master
    param_index: int  # the model parameter it is part of
    offset: int  # where it begins in its master
    param_begin: int  # where it begins in its parameter


def cut_pieces(master: nn.Parameter, parts: list[ParamSlice], whole_tensor: bool, size: int) -> list[Piece]:
    """A master's optimizer pieces: each parameter part whole for a whole-tensor optimizer, else cut to `size`
    elements (See [Note: optimizer pieces])."""
    values = master.detach()
    pieces = []
    for part in parts:
        if whole_tensor and not part.whole:
            raise RuntimeError(f"parameter {part.param_index} is split across ranks but its optimizer needs "
                               "whole tensors (an internal bug)")
        step = part.end - part.begin if whole_tensor else size
        for begin in range(part.begin, part.end, step):
            view = values[begin:min(begin + step, part.end)]
            pieces.append(Piece(nn.Parameter(view.view(part.shape) if whole_tensor else view), part.param_index,
                                begin, part.param_begin + begin - part.begin))
    return pieces


class ShardMasters:
    def __init__(self, homes: list[Home], slices: list[list[ParamSlice]], groups: list[int], plan: OptimizerPlan,
                 sub_group_size: int | None) -> None:
        """`homes[i]`: where master i lives (it knows the compute shard it publishes to); `slices[i]`: the
        parameter parts it holds; `groups[i]`: their flattened param group."""
        self.homes = homes
        self.masters = [nn.Parameter(home.master) for home in homes]
        self.pieces: list[list[Piece]] = [
            cut_pieces(master, parts, plan.refs[group].whole_tensor, piece_size(home, plan.refs[group], sub_group_size))
            for home, master, parts, group in zip(homes, self.masters, slices, groups)]
        for home, pieces in zip(homes, self.pieces):
            if home.paged:  # its records are runs of pieces (See [Note: paging a master through a bounded pool])
                home.divide([(piece.offset, piece.offset + piece.param.numel()) for piece in pieces])
        by_group: list[list[nn.Parameter]] = [[] for _ in plan.refs]
        for pieces, group in zip(self.pieces, groups):
            by_group[group] += [piece.param for piece in pieces]
        self.optimizers = [rebuild_optimizer(optimizer, [by_group[g] for g, ref in enumerate(plan.refs)
                                                         if ref.optimizer == which])
                           for which, optimizer in enumerate(plan.optimizers)]
        self._grads: list[torch.Tensor] = []  # fp32, attached to the pieces: from the square sum to the step
        self._used: Sequence[bool] = []  # which parameters some rank used, this step

    def initialise(self, index: int, values: torch.Tensor) -> None:
        """Master `index` starts from `values` (1-D, full precision: the user's own weights, not their
        16-bit rounding)."""
        self.homes[index].initialise(values)

    @property
    def optimizer(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        """The rebuilt optimizer, or the list of them when several were given."""
        return self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers

    # --- one optimizer step -----------------------------------------------------------------------
    def accept_grad(self, index: int, grad: torch.Tensor) -> None:
        """The reduced gradient of master `index` (1-D, reduce dtype), final for this step."""
        self.homes[index].accept_grad(grad)

    def unscaled_square_sum(self, scale: float, uncounted: frozenset[int] = frozenset()) -> float:
        """Attach every master's fp32 gradient to its pieces, divide it by the loss scale in place, and return
        the sum of its squares (float64: See [Note: one scalar decides overflow and norm] in precision/norm.py).
        `uncounted`: parameter indices whose squares are left out, though an inf or nan among them still makes the
        sum nan (See [Note: each element counted once across tensor and data ranks] in
        zerokit/parallel/tensor/share.py)."""
        grads = [home.grad32() for home in self.homes]
        for home, pieces, grad in zip(self.homes, self.pieces, grads):
            if not home.paged:  # a paged master's gradient is attached when it is paged in (See tiers/nvme_masters.py)
                for piece in pieces:
                    piece.param.grad = grad[piece.offset:piece.offset + piece.param.numel()].view(piece.param.shape)
        self._grads = grads
        unscale_(grads, scale)
        if not uncounted:  # an offload tier summed its squares on the device already
            return unscaled_square_sum(grads, [home.squares() for home in self.homes], scale)
        counted: list[torch.Tensor] = []
        left_out: list[torch.Tensor] = []
        for pieces, grad in zip(self.pieces, grads):
            for piece in pieces:
                view = grad[piece.offset:piece.offset + piece.param.numel()]
                (left_out if piece.param_index in uncounted else counted).append(view)
        return square_sum(counted) + 0.0 * square_sum(left_out)

    def drop_unused(self, used: Sequence[bool] | None) -> None:
        """Pieces of parameters that got no gradient on any rank lose theirs, so the optimizer skips them
        as torch's optimizers skip a parameter whose .grad is None (See [Note: parameters no rank used])."""
        if used is None:
            raise RuntimeError("the ranks' gradient usage was never reduced before the optimizer step "
                               "(an internal bug)")
        self._used = used
        for pieces in self.pieces:
            for piece in pieces:
                if not used[piece.param_index]:
                    piece.param.grad = None

    def step(self, clip: float = 1.0) -> None:
        """Scale the gradients by the clip coefficient (if below 1), then step every optimizer: the resident
        masters at once, then the paged ones one by one (See [Note: paging a master through a bounded pool])."""
        self.clip(clip)
        for optimizer in self.optimizers:
            optimizer.step()
        paged = [index for index, home in enumerate(self.homes) if home.paged]
        if paged:
            for pieces in self.pieces:  # resident pieces are done: they must not be stepped again
                for piece in pieces:
                    piece.param.grad = None
            self._step_paged(paged)

    def clip(self, coefficient: float) -> None:
        """Scale the gradients by the clip coefficient, if below 1."""
        if coefficient < 1.0:
            scale_(self._grads, coefficient)

    def _step_paged(self, paged: list[int]) -> None:
        """Sub-group by sub-group, master by master; See [Note: paging a master through a bounded pool]."""
        optimizer_of = self.optimizer_of()
        order = [(index, sub) for index in paged for sub in range(len(self.homes[index].sub_groups))]
        params = {index: [p.param for p in self.pieces[index]] for index in paged}
        offsets = {index: [p.offset for p in self.pieces[index]] for index in paged}
        ahead = max(1, self.homes[paged[0]].pool.count - 2)  # reads in flight; the rest: this one and a write
        for index, sub in order[:ahead]:
            self.homes[index].start_reading(sub)
        for position, (index, sub) in enumerate(order):
            home, pieces = self.homes[index], self.pieces[index]
            home.page_in(sub, params[index], offsets[index], optimizer_of, with_grad=True)
            for piece in (pieces[k] for k in home.sub_groups[sub].pieces):
                if not self._used[piece.param_index]:
                    piece.param.grad = None
            if position + ahead < len(order):  # read ahead while this one steps
                self.homes[order[position + ahead][0]].start_reading(order[position + ahead][1])
            for optimizer in self.optimizers:
                optimizer.step()
            home.publish_paged(sub)
            home.page_out(sub, params[index], optimizer_of)
        self.homes[paged[0]].pool.drain()

    def optimizer_of(self) -> dict[int, torch.optim.Optimizer]:
        return {id(p): o for o in self.optimizers for g in o.param_groups for p in g["params"]}

    def release_grads(self) -> None:
        self._grads = []
        for home, pieces in zip(self.homes, self.pieces):
            home.release()
            for piece in pieces:
                piece.param.grad = None

    def publish(self) -> None:
        """Updated masters -> their compute-dtype shards."""
        for home in self.homes:
            home.publish()

    def write_back(self) -> None:
        """The user edited the compute shards in place: make the masters agree."""
        for home in self.homes:
            home.write_back()

    # --- what it holds -------------------------------------------------------------------------------
    def held_by_tier(self) -> dict[str, dict[str, int]]:
        """Bytes held by tier (device, host, nvme) and category: masters, their host buffers, and the
        optimizers' state, each counted where its master lives; a paged master's record on NVMe, and the
        pool it pages through in host memory."""
        held: dict[str, dict[str, int]] = {tier: defaultdict(int) for tier in TIERS}
        state_of = {id(p): s for optimizer in self.optimizers for p, s in optimizer.state.items()}
        for home, pieces in zip(self.homes, self.pieces):
            for category, count in home.held().items():
                held[home.tier][category] += count
            held[home.tier]["optimizer_state"] += sum(
                tensor_bytes(state_of.get(id(piece.param), {}).values()) for piece in pieces)
        paged = [home for home in self.homes if home.paged]
        if paged:
            held["nvme"]["optimizer_state"] += sum(home.nvme_bytes() for home in paged)
            held["host"]["optimizer_state"] += paged[0].pool.held_bytes()
        return {tier: dict(categories) for tier, categories in held.items()}

    def piece_refs(self) -> list[PieceRef]:
        """Every optimizer piece this rank steps, with the parameter part it is and its optimizer."""
        optimizer_of = self.optimizer_of()
        return [PieceRef(piece.param_index, piece.param_begin, piece.param, optimizer_of[id(piece.param)])
                for pieces in self.pieces for piece in pieces]

    def __iter__(self):
        """The fp32 master tensors, one per bucket."""
        return iter(self.masters)

    def __len__(self) -> int:
        return len(self.masters)

    @property
    def piece_count(self) -> int:
        return sum(len(pieces) for pieces in self.pieces)

    @contextmanager
    def resident(self, index: int, publish: bool = False) -> Iterator[None]:
        """Master `index` and its pieces' optimizer state in memory until exit (a paged master is paged in,
        and written back after: changes made inside are kept; publish=True: and published to the compute
        shard first, as a step publishes it). Reading or writing masters outside a step (state_dict,
        checkpoints) goes through this."""
        home = self.homes[index]
        if not home.paged:
            yield
            return
        pieces, optimizer_of = self.pieces[index], self.optimizer_of()
        params, offsets = [p.param for p in pieces], [p.offset for p in pieces]
        for sub in range(len(home.sub_groups)):  # all at once: the pool lends beyond its count until they are back
            home.page_in(sub, params, offsets, optimizer_of, with_grad=False)
        try:
            yield
        finally:
            for sub in range(len(home.sub_groups)):
                if publish:
                    home.publish_paged(sub)
                home.page_out(sub, params, optimizer_of)
            home.pool.drain()

    @contextmanager
    def all_resident(self, publish: bool = False) -> Iterator[None]:
        """Every master in memory until exit (See resident), for checkpoints, which read and write the pieces'
        values and state outside a step. An NVMe-offloaded run holds its whole optimizer state in host memory
        for that moment, as it would without offload."""
        with ExitStack() as stack:
            for index in range(len(self.homes)):
                stack.enter_context(self.resident(index, publish))
            yield


def share_optimizers(first: ShardMasters, second: ShardMasters, plan: OptimizerPlan) -> None:
    """One rebuilt optimizer of each of the user's over the pieces of both `first` and `second` (two stages of one
    model: See [Note: ZeRO over experts split across ranks] in zerokit/parallel/experts/share.py), given to both:
    `first.step` steps it, after `second.clip`; a schedule over it sets both."""
    shared = [rebuild_optimizer(optimizer, [a["params"] + b["params"] for a, b in zip(mine.param_groups,
                                                                                      theirs.param_groups)])
              for optimizer, mine, theirs in zip(plan.optimizers, first.optimizers, second.optimizers)]
    first.optimizers = second.optimizers = shared
