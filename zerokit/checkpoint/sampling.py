"""A distributed sampler that resumes in the middle of an epoch, and a loader that counts what it handed out: the
data position a checkpoint saves beside the model states (See [Note: the data position]).

[Note: the data position]
A resumed run must see exactly the samples the uninterrupted run would have seen from the saved step on: none twice,
none skipped. torch's DistributedSampler gives each rank `indices[rank::num_replicas]` of one permutation per epoch
(seeded by seed + epoch); it can only start an epoch from its beginning. ResumableSampler is that sampler, the same
order, plus where this rank stands in the epoch: `taken`, how many of this rank's indices the training loop has
taken. Its state_dict() is (epoch, taken, and what the order depends on: seed, shuffle, drop_last, the number of
ranks and the dataset's size); after load_state_dict() its next pass starts at index `taken` of that epoch's list,
and later passes from the start, as before.
Counting "taken" where the loop takes a batch, not where the sampler yields an index: a DataLoader with workers
draws indices ahead of the loop (prefetch_factor batches per worker), so the sampler alone would count batches
no step has seen. ResumableLoader counts the batches it hands out and sets `taken` from them (batches x batch
size: every batch of a pass but its last is whole); iterated without it, or by a DataLoader without workers, which
draws a batch's indices when the loop asks for the batch, the sampler counts itself, exactly.
The epoch is the loop's to set, as with torch's sampler (set_epoch; DeepSpeed's loader never does, so every pass
has the same order): a resumed loop that sets it writes `for epoch in range(sampler.epoch, epochs)`, and setting the
epoch the sampler stands in keeps its position. A pass saved at its end resumes as an empty pass, so that the loop
goes on to the next one, as the uninterrupted loop did.
Another number of ranks: all ranks stand at the same `taken` at a step boundary, so `taken x ranks` positions of
the epoch's permutation are consumed; the new ranks start at `taken x old ranks // new ranks`, which skips nothing
and repeats fewer samples than there are ranks (the permutation is the same for any number of ranks; only the
padding at its end differs).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zerokit._support.log import logger

ORDER_KEYS = ("seed", "shuffle", "drop_last", "dataset_size")  # what the order of an epoch depends on


class ResumableSampler(DistributedSampler):
    """torch's DistributedSampler (the same indices in the same order) that saves and restores where this rank
    stands in the epoch. See [Note: the data position]."""

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.taken = 0  # indices of this epoch's list (this rank's) the training loop has taken
        self.pass_start = 0  # where the pass in progress started
        self.resume_at = 0  # where the next pass starts (load_state_dict sets it; a pass resets it)
        self.counted_by_loader = False  # a ResumableLoader sets `taken` from the batches it hands out

    def __iter__(self) -> Iterator[int]:
        order = list(super().__iter__())
        self.pass_start, self.resume_at = self.resume_at, 0
        self.taken = self.pass_start
        for index in order[self.pass_start:]:
            if not self.counted_by_loader:
                self.taken += 1
            yield index

    def set_epoch(self, epoch: int) -> None:
        """As torch's; setting another epoch than the one it stands in starts that epoch from its beginning."""
        if epoch != self.epoch:
            self.taken = self.resume_at = 0
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "taken": self.taken, "num_replicas": self.num_replicas, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass starts where the saved one stood (See [Note: the data position])."""
        mine = self.state_dict()
        differing = [f"{key} {state.get(key)!r} (now {mine[key]!r})" for key in ORDER_KEYS
                     if state.get(key) != mine[key]]
        if differing:
            raise ValueError("the saved data position is for another order of samples: "
                             f"saved with {', '.join(differing)}; "
                             "resume with the dataset and sampler settings of the saving run")
        taken = int(state["taken"])
        if state["num_replicas"] != self.num_replicas:
            taken = taken * int(state["num_replicas"]) // self.num_replicas
            if self.rank == 0:
                logger.info(f"data position saved by {state['num_replicas']} ranks, resumed by {self.num_replicas}: "
                            f"each rank starts at index {taken} of the epoch's list (nothing skipped, fewer than "
                            f"{self.num_replicas} samples seen again)")
        self.epoch = int(state["epoch"])
        self.taken = self.resume_at = min(taken, self.num_samples)


class ResumableLoader(DataLoader):
    """A DataLoader over a ResumableSampler that tells it how many batches the loop took (exact with workers too);
    its state_dict() is the sampler's. `data_sampler` is the sampler, as on DeepSpeed's loader."""

    def __init__(self, dataset: Dataset, sampler: ResumableSampler, **options: Any) -> None:
        super().__init__(dataset, sampler=sampler, **options)
        sampler.counted_by_loader = True

    @property
    def data_sampler(self) -> ResumableSampler:
        return self.sampler

    def __iter__(self) -> Iterator[Any]:
        sampler, handed_out = self.sampler, 0
        for batch in super().__iter__():  # the sampler sets pass_start when the first batch's indices are drawn
            handed_out += 1
            sampler.taken = min(sampler.pass_start + handed_out * self.batch_size, sampler.num_samples)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def resumable_loader(dataset: Dataset, batch_size: int, rank: int, world_size: int, shuffle: bool = True,
                     seed: int = 0, drop_last: bool = False, **options: Any) -> ResumableLoader:
    """This rank's share of `dataset`, batch by batch, in DistributedSampler's order, with a position checkpoints
    save (engine.data_position.track(loader)). `options`: DataLoader's (collate_fn, num_workers, ...)."""
    sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    options.setdefault("pin_memory", torch.cuda.is_available())
    return ResumableLoader(dataset, sampler, batch_size=batch_size, drop_last=drop_last, **options)


__all__ = ["ResumableLoader", "ResumableSampler", "resumable_loader"]
