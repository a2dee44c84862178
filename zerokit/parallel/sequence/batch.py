"""A replica's batch cut into its sequence ranks' shards, and their losses combined into the replica's.

[Note: one loss over a sequence split across ranks]
Each sequence rank computes the loss of its own tokens. The labels are shifted before the batch is cut (a shard's
last token predicts the first token of the next shard), so every rank's `shift_labels` are exactly its tokens'
targets. The replica's loss is the mean over all its tokens that have a target: every rank sums its tokens' losses,
and the sums and the counts are added over the sequence ranks (`summed`), so every rank holds the same loss, as one
process holds it over the whole sequence. The backward of that sum hands each rank's sum the whole gradient (every
rank's loss depends on it), so each rank's gradients are the sequence ranks' count times its own part, and ZeRO's
average over replicas and sequence ranks alike (See [Note: the sequence dimension] in parallel/mesh.py) gives the
mean over replicas of each replica's sequence-mean gradient: what one process training on the replicas' batches
computes. Shards with different numbers of target tokens (masked labels) are weighed by their counts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from zerokit.parallel.sequence.exchange import summed

IGNORE_INDEX = -100  # torch's cross_entropy and transformers' labels: no target here


def shard_batch(batch: dict[str, Any], rank: int, ranks: int) -> dict[str, Any]:
    """This sequence rank's part of a batch of (batch, tokens, ...) tensors: `input_ids`, `labels` (replaced by the
    shard's `shift_labels`: See [Note: one loss over a sequence split across ranks]), `position_ids` (made from the
    token positions when absent), and any other tensor cut alike; other values as they are. A length the degree does
    not divide is refused."""
    tokens = batch["input_ids"].shape[1]
    if tokens % ranks:
        raise ValueError(f"a batch of {tokens} tokens per sequence does not split over {ranks} sequence ranks: pad the "
                         f"sequences to a multiple of {ranks} (labels {IGNORE_INDEX} on the padding)")
    batch = dict(batch)
    if "labels" in batch:
        batch["shift_labels"] = F.pad(batch.pop("labels"), (0, 1), value=IGNORE_INDEX)[:, 1:]
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(tokens, device=batch["input_ids"].device).expand_as(batch["input_ids"])
    size = tokens // ranks
    return {key: value[:, rank * size:(rank + 1) * size] if _per_token(value, tokens) else value
            for key, value in batch.items()}


def _per_token(value: Any, tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == tokens


class TokenLosses(NamedTuple):
    """A loss over some tokens, before its mean: what a pipeline's last stage returns from its loss_fn under sequence
    parallelism (See [Note: a pipeline's loss over a sequence split across ranks] in zerokit/pipeline/engine.py)."""
    total: torch.Tensor
    """The sum of the tokens' losses (a scalar, with its graph)."""
    targets: torch.Tensor
    """How many tokens have a target (a scalar)."""


def next_token_losses(logits: torch.Tensor, shift_labels: torch.Tensor) -> TokenLosses:
    """The summed next-token loss of this rank's tokens and their count of targets (labels IGNORE_INDEX have none)."""
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return TokenLosses(total, (shift_labels != IGNORE_INDEX).sum().to(total.dtype))


def combined_loss(losses: TokenLosses, group: Any) -> torch.Tensor:
    """The mean over every target token of the ranks of `group` (None: this rank's alone), on every one of them (See
    [Note: one loss over a sequence split across ranks])."""
    if group is None:
        return losses.total / losses.targets.detach()
    return summed(losses.total, group) / summed(losses.targets.detach(), group)


def sequence_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group: Any) -> torch.Tensor:
    """The replica's mean next-token loss over every token with a target, on every sequence rank, from this rank's
    logits and shifted labels (See [Note: one loss over a sequence split across ranks])."""
    return combined_loss(next_token_losses(logits, shift_labels), group)


def shard_position_ids(shard: torch.Tensor, index: int) -> torch.Tensor:
    """The (rows, tokens) position ids of a shard of unpacked sequences, part `index` of each: its tokens' places in
    the whole sequence, as shard_batch makes them for a batch without position_ids. `shard`: anything shaped (rows,
    tokens, ...), the shard's input_ids or its hidden states; a pipeline stage makes its positions with it (See
    [Note: position ids where a model makes them] in attention.py)."""
    rows, tokens = shard.shape[0], shard.shape[1]
    positions = torch.arange(index * tokens, (index + 1) * tokens, device=shard.device)
    return positions.expand(rows, tokens)
