"""`deepspeed.runtime.sequence_parallel.ulysses_sp` for zerokit: DeepSpeed's ALST entry points over zerokit's Ulysses
(zerokit/parallel/sequence), so that an ALST script runs with its import changed.

[Note: register_with_transformers under zerokit]
DeepSpeed's register_with_transformers makes the sequence groups and replaces transformers' `sdpa` (or flash)
function for the whole process, before the model may even exist (it takes a model or a name). zerokit makes the
same groups and records the request; the engine that `deepspeed.initialize(model=..., mpu=mpu)` builds attaches
Ulysses to that model alone (See [Note: Ulysses under transformers' attention interface]), once it has checked the
model's attention implementation is the one registered, as DeepSpeed checks it. Unlike DeepSpeed, eager attention
is accepted (zerokit gives it a causal mask over the whole sequence).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

import zerokit.deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp
from zerokit.parallel.sequence.attention import keep_whole_in_eval
from zerokit.parallel.sequence.batch import shard_batch
from zerokit.parallel.sequence.tiling import TOKENS, check_tiles, checkpointed, token_slices

_REQUEST: dict[str, Any] = {}


class UlyssesSPAttentionHF:
    """DeepSpeed's ALST attention, by its registration (See [Note: register_with_transformers under zerokit])."""

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """The sequence groups made and the request recorded; returns the mpu for deepspeed.initialize(mpu=...),
        None for a degree of 1 (as DeepSpeed)."""
        if sequence_parallel_size == 1:
            return None
        if not seq_length_is_variable and (seq_length or max_length) is None:
            raise ValueError("seq_length_is_variable=False needs seq_length, the fixed length of every batch")
        loaded = getattr(model_name_or_path, "config", None)
        saved = getattr(loaded, "_attn_implementation", None)
        if saved is not None and saved != core_attn_implementation:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match the model's "
                             f"attn_implementation='{saved}': set both to the same value")
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        _REQUEST.update(core=core_attn_implementation, size=sequence_parallel_size, whole_in_eval=disable_in_eval)
        return parallel_state_sp


def sequence_degree_of(mpu: Any, model: torch.nn.Module) -> int:
    """The sequence degree an mpu from register_with_transformers asks of deepspeed.initialize, the model checked
    against the registration; refused in one line for any other mpu (model parallelism zerokit does not offer)."""
    if mpu is not parallel_state_sp:
        raise ValueError("deepspeed.initialize(mpu=...) takes the mpu UlyssesSPAttentionHF.register_with_transformers "
                         "returns (sequence parallelism); other model-parallel mpus are not offered by zerokit")
    core = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if core != _REQUEST["core"]:
        raise ValueError(f"the model runs attention {core!r} but register_with_transformers was given "
                         f"core_attn_implementation={_REQUEST['core']!r}: load it with the same")
    return _REQUEST["size"]


def after_initialize(model: torch.nn.Module) -> None:
    """What the registration asked of the attached model beyond its degree: disable_in_eval (See
    keep_whole_in_eval)."""
    if _REQUEST.get("whole_in_eval"):
        keep_whole_in_eval(model)


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's adapter: each batch the wrapped loader gives a sequence rank is cut over the sequence ranks, so
    that the next `sp_world_size` micro-batches on every rank are the shards of rank 0's batch, then rank 1's, and so
    on; labels become the shards' `shift_labels`. Batches must hold `position_ids`, as DeepSpeed requires."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size, self.device = (dl, sp_rank, sp_group,
                                                                                   sp_world_size, device)
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts over, as DeepSpeed's
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses sequence parallelism needs position_ids in every batch (each token's position "
                             "in its sequence, torch.arange(seq_len) for unpacked rows): add them in the collator")
        for gathered in self._every_ranks(batch):
            self.micro_batches.append(shard_batch(gathered, self.sp_rank, self.sp_world_size))

    def _every_ranks(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Every sequence rank's batch, in rank order (their lengths may differ)."""
        length = torch.tensor([batch["input_ids"].shape[1]], dtype=torch.int64)
        lengths = [torch.zeros_like(length) for _ in range(self.sp_world_size)]
        dist.all_gather(lengths, length, group=self.sp_group)
        batches: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                parts = [torch.zeros((value.shape[0], int(n), *value.shape[2:]), dtype=value.dtype) for n in lengths]
                dist.all_gather(parts, value.contiguous().cpu(), group=self.sp_group)
            else:
                parts = [None] * self.sp_world_size
                dist.all_gather_object(parts, value, group=self.sp_group)
            for rank, part in enumerate(parts):
                batches[rank][key] = part.to(self.device) if isinstance(part, torch.Tensor) else part
        return batches


# [Note: DeepSpeed's tiled compute over zerokit's tiling]
# DeepSpeed writes TiledMLP, TiledFusedLogitsLoss and SequenceTiledCompute as autograd functions that run their own
# backward slice by slice (TiledFusedLogitsLoss inside its forward), and marks the weights they use
# (`compute_params`, `ds_grad_is_ready`) so that its ZeRO reduces their gradients after the last slice only. Here
# each is its call form over zerokit's tiling: every slice under non-reentrant checkpointing, parts of one autograd
# graph (See [Note: tiling along the sequence] in zerokit/parallel/sequence/tiling.py). A weight's gradient hook then
# fires once, after its last use, and zerokit's reducer needs no marking: compute_params is accepted and not used.


class TiledMLP:
    """DeepSpeed's TiledMLP: `TiledMLP.apply(fn, self, x, shards, compute_params)` is fn(self, x) computed over
    `shards` slices of x's tokens (dim -2: (batch, tokens, hidden) or an MoE expert's (tokens, hidden)), one slice's
    intermediates alive at a time (See [Note: DeepSpeed's tiled compute over zerokit's tiling])."""

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], self: torch.nn.Module, x: torch.Tensor, shards: int,
              compute_params: Any = None) -> torch.Tensor:
        check_tiles(shards)
        return torch.cat([checkpointed(fn, self, part) for part in token_slices(x, shards)], dim=TOKENS)


class TiledFusedLogitsLoss:
    """DeepSpeed's TiledFusedLogitsLoss: `.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)` is
    the "mean" or "sum" of fn(self, x_part, y_part[, mask_part]) over the parts torch.chunk cuts from the flattened
    (batch * tokens) rows, as DeepSpeed cuts them; each part's logits alive only inside its call (See [Note:
    DeepSpeed's tiled compute over zerokit's tiling]). "mean" is over the parts: where they count different targets,
    return sums from fn and use "sum", as DeepSpeed advises."""

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], self: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              mask: torch.Tensor | None, shards: int, compute_params: Any = None,
              output_reduction: str = "mean") -> torch.Tensor:
        _check_logits_loss_inputs(x, y, mask, output_reduction)
        check_tiles(shards)
        flat = [x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])]  # (batch * tokens, ...) each
        if mask is not None:
            flat.append(mask.reshape(-1))
        parts = zip(*(torch.chunk(tensor, shards, dim=0) for tensor in flat))
        losses = torch.stack([checkpointed(fn, self, *part) for part in parts])
        return losses.mean() if output_reduction == "mean" else losses.sum()


def _check_logits_loss_inputs(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"output_reduction={reduction!r}: TiledFusedLogitsLoss takes \"mean\" or \"sum\"")
    if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be (batch, tokens, ...) with the same "
                         "batch and tokens")
    if mask is not None and mask.shape != x.shape[:2]:
        raise ValueError(f"mask {tuple(mask.shape)} must be (batch, tokens) = {tuple(x.shape[:2])}")


def sequence_tiled_compute(fn: Callable[..., torch.Tensor], seqlen: int, shards: int,
                           kwargs_to_shard: dict[str, torch.Tensor], kwargs_to_pass: dict[str, Any],
                           grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> torch.Tensor:
    """DeepSpeed's sequence_tiled_compute: fn(**slices, **kwargs_to_pass) over the slices of every
    kwargs_to_shard value along dim 1 (seqlen / shards tokens each, rounded up, as DeepSpeed cuts them), the
    outputs joined along output_unshard_dimension (0: stacked, for per-slice losses), then None, "mean" or "sum".
    Gradients reach every input that requires one, grad_requiring_tensor_key's included (DeepSpeed computes that
    one's alone); See [Note: DeepSpeed's tiled compute over zerokit's tiling]."""
    if grad_requiring_tensor_key not in {**kwargs_to_shard, **kwargs_to_pass}:
        raise ValueError(f"grad_requiring_tensor_key={grad_requiring_tensor_key!r} names none of the arguments "
                         f"({', '.join([*kwargs_to_shard, *kwargs_to_pass])})")
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"output_reduction={output_reduction!r}: give None, \"mean\" or \"sum\"")
    check_tiles(shards)
    step = -(-seqlen // shards)
    keys = list(kwargs_to_shard)

    def on_slice(*values: torch.Tensor) -> torch.Tensor:
        return fn(**dict(zip(keys, values)), **kwargs_to_pass)

    outputs = [checkpointed(on_slice, *(value[:, start:start + step] for value in kwargs_to_shard.values()))
               for start in range(0, seqlen, step)]
    joined = torch.stack(outputs) if output_unshard_dimension == 0 else torch.cat(outputs, output_unshard_dimension)
    if output_reduction is None:
        return joined
    return joined.mean() if output_reduction == "mean" else joined.sum()


class SequenceTiledCompute:
    """DeepSpeed's SequenceTiledCompute by its call form, `.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass,
    grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction, *args)`, the args the
    values of keys_to_shard then of keys_to_pass (See sequence_tiled_compute)."""

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], seqlen: int, shards: int, keys_to_shard: list[str],
              keys_to_pass: list[str], grad_requiring_tensor_key: str, compute_params: Any,
              output_unshard_dimension: int, output_reduction: str | None, *args: Any) -> torch.Tensor:
        to_shard = dict(zip(keys_to_shard, args))
        to_pass = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        return sequence_tiled_compute(fn, seqlen, shards, to_shard, to_pass, grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction)


__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]
