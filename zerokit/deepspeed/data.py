"""The loader initialize(training_data=...) returns: this rank's share of the dataset, micro-batch by
micro-batch, in the order DeepSpeed's loader gives it.

DeepSpeed's DeepSpeedDataLoader draws from a DistributedSampler over the data-parallel ranks (shuffled with
its default seed 0, and the same order every epoch, since it never calls set_epoch) at
train_micro_batch_size_per_gpu, dropping the last incomplete batch with dataloader_drop_last. This loader
does the same with a plain torch DataLoader, so a script sees the same batches under either. Where DeepSpeed
starts two worker processes per rank, zerokit loads in the training process (num_local_io_workers sets
workers), since small scripts on a few cores lose more to worker start-up than they gain.

The sampler is zerokit's ResumableSampler, DistributedSampler's order with a position (See [Note: the data
position] in zerokit/checkpoint/sampling.py), and the loader a ResumableLoader. The engine's first training loader is
tracked (engine.data_position): every checkpoint saves where it stands, and a load puts it back, so that a resumed run
sees the samples the uninterrupted run would have seen from the saved step on. DeepSpeed saves its loader's
`data_sampler.state_dict()` only with its curriculum-learning sampler.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from zerokit.checkpoint.data_position import DataPosition
from zerokit.checkpoint.sampling import ResumableLoader, ResumableSampler


def training_loader(dataset: Any, batch_size: int, rank: int, world_size: int, drop_last: bool = False,
                    collate_fn: Callable | None = None, sampler: Any = None, shuffle: bool = True,
                    workers: int = 0, position: DataPosition | None = None) -> DataLoader:
    """position: the engine's, for a training loader: it tracks the first ResumableLoader made."""
    if not isinstance(dataset, (Dataset, IterableDataset)):
        raise ValueError(f"training_data must be a torch Dataset, not {type(dataset).__name__}")
    options = dict(batch_size=batch_size, collate_fn=collate_fn, drop_last=drop_last, num_workers=workers,
                   pin_memory=torch.cuda.is_available())
    if sampler is not None or isinstance(dataset, IterableDataset):
        return DataLoader(dataset, sampler=sampler, **options)
    loader = ResumableLoader(dataset, ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle),
                             **options)
    if position is not None and not position.tracked:
        position.track(loader)
    return loader


__all__ = ["training_loader"]
