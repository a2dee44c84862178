"""Sequence parallelism (Ulysses) for Hugging Face models, composed with ZeRO 0-3: each replica's sequences split over
`sequence_parallel_size` consecutive ranks, attention exchanged by head around its core, the loss combined by token
count. See docs/sequence_parallel.md, [Note: the sequence dimension] in zerokit/parallel/mesh.py, and the notes of
attention.py and batch.py.

    engine = zerokit.initialize(model, optimizer, {"sequence_parallel_size": 2, ...})
    shard = engine.sequence.shard(batch)                # this rank's tokens, shifted labels, position ids
    logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    loss = engine.sequence.loss(logits, shard["shift_labels"])   # the replica's loss, on every sequence rank

At long sequences, tiling.py's tile_mlp(model, tiles) and the tiled loss keep one slice of the MLP's intermediates
and of the logits alive at a time:

    hidden = engine.sequence.hidden_states(engine, input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    loss = engine.sequence.tiled_loss(hidden, engine.module.lm_head, shard["shift_labels"], tiles=4)

Under a pipeline (zerokit.pipeline.initialize with a layout of pipeline x sequence ranks), each stage makes its
tokens' positions with shard_position_ids and the last stage's loss_fn returns next_token_losses (See
docs/pipeline.md).
"""

from zerokit.parallel.sequence.attention import ULYSSES, attach
from zerokit.parallel.sequence.batch import (IGNORE_INDEX, TokenLosses, combined_loss, next_token_losses,
                                             sequence_loss, shard_batch, shard_position_ids)
from zerokit.parallel.sequence.exchange import all_to_all, summed
from zerokit.parallel.sequence.tiling import final_hidden_states, tile_mlp, tiled_loss

__all__ = ["IGNORE_INDEX", "TokenLosses", "ULYSSES", "all_to_all", "attach", "combined_loss", "final_hidden_states",
           "next_token_losses", "sequence_loss", "shard_batch", "shard_position_ids", "summed", "tile_mlp",
           "tiled_loss"]
