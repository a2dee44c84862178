"""The demo's data: the corpus that ships with zerokit, as characters, in random windows per rank."""

from __future__ import annotations

from importlib import resources

import torch


def load_corpus() -> str:
    return resources.files("zerokit").joinpath("data/corpus.txt").read_text(encoding="utf-8")


class CharTokenizer:
    def __init__(self, text: str) -> None:
        self.alphabet = sorted(set(text))
        self.index = {char: i for i, char in enumerate(self.alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[char] for char in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids)


class WindowSampler:
    """Random (batch, block + 1) windows; each rank draws its own batches from its own seed, so the
    ranks together see a batch world_size times larger, as data parallelism intends."""

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, seed: int) -> None:
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.block_size - 1, (self.batch_size,), generator=self.generator)
        return torch.stack([self.tokens[s:s + self.block_size + 1] for s in starts.tolist()])
