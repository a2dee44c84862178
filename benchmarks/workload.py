"""The one workload every contender trains: the same model, initial weights, data and optimizer.

The model is zerokit's test GPT (zerokit/testing/models.py) made bigger and without its test-only
layers, so that a step takes about a second on one CPU thread and timing noise stays small beside it.
The data is synthetic and learnable in context: each row is an arithmetic sequence modulo the
vocabulary, (start + stride * t) % vocab, with start and stride drawn per row from a generator seeded
by (seed, rank, step). The loss therefore falls visibly within a few steps, which is what lets the
loss check tell a contender that trains wrong from one that trains right.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from zerokit.testing.models import TinyGPT, TinyGPTConfig, param_groups

DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "muon")
EVAL_RANK = -1  # the data stream of the evaluation batch, which every rank and contender shares


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """Everything that must be equal across contenders for the comparison to mean anything."""

    world_size: int = 2
    steps: int = 6
    """Timed optimizer steps, each after a barrier."""
    warmup: int = 2
    """Untimed optimizer steps first (allocations, optimizer state, lazy initialisation)."""
    dtype: str = "fp32"
    """fp32, or bf16 mixed precision (bf16 compute, fp32 master weights and Adam state)."""
    n_layer: int = 6
    n_embd: int = 384
    n_head: int = 6
    block_size: int = 128
    vocab_size: int = 512
    batch_size: int = 4
    """Sequences per rank per step."""
    bucket_bytes: int = 25 * 2**20
    """Gradient bucket size in bytes of the reduced dtype, for every contender that has the knob
    (torch DDP bucket_cap_mb, DeepSpeed reduce_bucket_size and allgather_bucket_size, zerokit
    reduce_bucket_bytes). 25 MiB is torch DDP's default."""
    lr: float = 1e-3
    seed: int = 0
    optimizer: str = "adamw"
    """adamw: torch AdamW; muon: torch Muon on the matrices (DeepSpeed's rule: 2-D, not an embedding or the
    head) beside AdamW on the rest, two optimizers."""
    muon_lr: float = 0.02

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is not benchmarked; use one of {', '.join(OPTIMIZERS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not benchmarked; use one of {', '.join(DTYPES)}")
        if self.world_size < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError(f"need world_size >= 1, steps >= 1, warmup >= 0; got {self.world_size}, "
                             f"{self.steps}, {self.warmup}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32

    def model_config(self) -> TinyGPTConfig:
        return TinyGPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                             n_head=self.n_head, n_embd=self.n_embd, with_test_features=False)

    def as_dict(self) -> dict:
        return asdict(self)


def make_model(settings: BenchSettings) -> TinyGPT:
    """The same fp32 initial weights in every process of every contender."""
    torch.manual_seed(settings.seed)
    return TinyGPT(settings.model_config())


def adamw_hyperparameters(settings: BenchSettings) -> dict:
    return {"lr": settings.lr, "betas": (0.9, 0.95)}


def optimizer_groups(model: nn.Module) -> list[dict]:
    """nanoGPT's two param groups: matrices decay, vectors (biases, norms) do not."""
    return param_groups(model, weight_decay=0.1)


def make_optimizer(model: nn.Module, settings: BenchSettings) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """torch AdamW, the same for every contender (fp32 state; the for-loop implementation on CPU); with
    --optimizer muon, [torch Muon over the matrices, torch AdamW over the rest]."""
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(optimizer_groups(model), **adamw_hyperparameters(settings))
    matrices = muon_parameters(model)
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return [torch.optim.Muon(matrices, **muon_hyperparameters(settings)),
            torch.optim.AdamW(rest, weight_decay=0.0, **adamw_hyperparameters(settings))]


def muon_hyperparameters(settings: BenchSettings) -> dict:
    return {"lr": settings.muon_lr, "momentum": 0.95, "weight_decay": 0.1}


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """DeepSpeed's rule (deepspeed.set_optimizer_flags), so every contender splits the model alike."""
    return [p for name, p in model.named_parameters()
            if p.dim() >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))]


def union_batch(settings: BenchSettings, step: int) -> torch.Tensor:
    """Every rank's batch at `step`, stacked: what one process trains on to take the ranks' step alone."""
    return torch.cat([make_batch(settings, rank, step) for rank in range(settings.world_size)])


def make_batch(settings: BenchSettings, rank: int, step: int) -> torch.Tensor:
    """(batch, block_size + 1) tokens for `rank` at `step`; the same for every contender."""
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + (rank + 1) * 10_007 + step)
    start = torch.randint(0, settings.vocab_size, (settings.batch_size, 1), generator=generator)
    stride = torch.randint(1, 8, (settings.batch_size, 1), generator=generator)
    positions = torch.arange(settings.block_size + 1).unsqueeze(0)
    return (start + stride * positions) % settings.vocab_size
