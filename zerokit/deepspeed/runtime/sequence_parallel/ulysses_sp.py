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
from typing import Any

import torch
import torch.distributed as dist

import zerokit.deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp
from zerokit.parallel.sequence.attention import keep_whole_in_eval
from zerokit.parallel.sequence.batch import shard_batch

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


__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
