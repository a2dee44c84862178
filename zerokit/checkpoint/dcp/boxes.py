"""A run of elements of a flattened tensor as the boxes torch.distributed.checkpoint describes chunks by.

[Note: a flat range as boxes]
zerokit holds each rank's part of a parameter as a run of its flattened elements, cut at any offset; DCP
describes every chunk as a box (offsets and sizes in each dimension). A run of a row-major tensor is the
union of at most 2 x ndim - 1 boxes: the rest of its first row (itself a run of the row's tensor, cut the
same way), the whole rows after it, and the start of its last row. Each box is a contiguous run too, so its
values are a view of the run's memory, shaped, and nothing is copied to save or to load them. DCP's
resharding reads overlaps of boxes, so an FSDP2 job's Shard(0) rows read zerokit's boxes and zerokit's
boxes read FSDP2's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    begin: int  # its first element in the flattened tensor (its elements run on from there)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes_of_run(shape: tuple[int, ...], begin: int, end: int) -> list[Box]:
    """The boxes that make up elements [begin, end) of a tensor of `shape`, in order (See [Note: a flat range
    as boxes])."""
    if begin >= end:
        return []
    if not shape:
        return [Box((), (), 0)]
    row = math.prod(shape[1:])
    boxes = []
    if begin % row:
        head_row, head_end = begin // row, min(end, (begin // row + 1) * row)
        in_row = boxes_of_run(shape[1:], begin % row, head_end - head_row * row)
        boxes += [_in_row(box, head_row, row) for box in in_row]
        begin = head_end
    whole_rows_end = end // row * row
    if begin < whole_rows_end:
        boxes.append(Box((begin // row, *[0] * (len(shape) - 1)), (whole_rows_end // row - begin // row, *shape[1:]),
                         begin))
        begin = whole_rows_end
    if begin < end:
        tail_row = begin // row
        boxes += [_in_row(box, tail_row, row) for box in boxes_of_run(shape[1:], 0, end - begin)]
    return boxes


def _in_row(box: Box, row_index: int, row: int) -> Box:
    """A box of one row's tensor as a box of the whole tensor."""
    return Box((row_index, *box.offsets), (1, *box.sizes), row_index * row + box.begin)


def box_view(run: torch.Tensor, run_begin: int, box: Box) -> torch.Tensor:
    """The box's elements within `run` (a flat tensor holding elements [run_begin, ...)), shaped as the box."""
    return run.view(-1)[box.begin - run_begin:box.begin - run_begin + box.numel].view(box.sizes)


def run_of(sources: list[torch.Tensor], begin: int, end: int) -> torch.Tensor:
    """Elements [begin, end) of the run that `sources` make back to back: a view where one source holds them all
    (a rank's pieces of a parameter meet only at piece boundaries), else a copy."""
    parts, offset = [], 0
    for source in sources:
        flat = source.reshape(-1)
        first, last = max(begin, offset), min(end, offset + flat.numel())
        if first < last:
            parts.append(flat[first - offset:last - offset])
        offset += flat.numel()
    return parts[0] if len(parts) == 1 else torch.cat(parts)
