"""What the DeepSpeed-style scripts here share with the tests that check them: a small language model and a
token dataset, plain torch (no zerokit, no DeepSpeed), so that a script and the loop written against zerokit's
own API build exactly the same things."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQUENCE, SAMPLES = 61, 128, 16, 48


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenModel(nn.Module):
    """Embedding, two residual MLP blocks (each over 100k parameters: a stage-3 unit), a head; forward returns
    the next-token loss, as models handed to deepspeed.initialize often do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([MLPBlock() for _ in range(2)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def build_model(seed: int = 1234) -> TokenModel:
    torch.manual_seed(seed)
    return TokenModel()


def dataset(seed: int = 99) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQUENCE + 1), generator=generator))


def write_result(out: str, rank: int, result: dict) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))
