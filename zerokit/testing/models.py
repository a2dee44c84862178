"""A GPT-like model small enough for CPU tests, with every feature that trips up sharding:
tied input/output embeddings, a no-weight-decay group, a frozen layer, a layer that only some
batches use (so some ranks see no gradient for it), and optional activation checkpointing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = 67  # prime, so nothing divides evenly by accident
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 24
    checkpoint_blocks: bool = False
    with_test_features: bool = True  # the frozen and the sometimes-unused layers
    reuse_first_block: bool = False  # run blocks[0] a second time at the end (a module called twice)
    # Data-dependent block order: when the second sequence starts with token 1, the blocks run in reverse.
    reverse_on_marker: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (B, n_head, T, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        causal = torch.ones(time, time, dtype=torch.bool, device=x.device).tril()  # no buffer: meta-friendly
        scores = scores.masked_fill(~causal, float("-inf"))
        y = F.softmax(scores.float(), dim=-1).to(v.dtype) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(batch, time, channels))


class Block(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        if config.with_test_features:
            self.frozen = nn.Linear(config.n_embd, config.n_embd)
            self.frozen.requires_grad_(False)
            self.sometimes = nn.Linear(config.n_embd, config.n_embd)
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        blocks = [*self.blocks, self.blocks[0]] if self.config.reuse_first_block else list(self.blocks)
        if self.config.reverse_on_marker and idx.size(0) > 1 and int(idx[1, 0]) == 1:
            blocks.reverse()
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.config.checkpoint_blocks else block(x)
        if self.config.with_test_features:
            x = x + 0.5 * torch.tanh(self.frozen(x))
            if int(idx[0, 0]) % 3 == 0:  # data-dependent: some batches, so some ranks, skip it
                x = x + self.sometimes(x)
        return self.lm_head(self.ln_f(x))


class TinyMoE(nn.Module):
    """A top-1 mixture of experts whose routing is decided by the token (expert = token id % n_experts), with
    a learned gate that scales each expert's output: a batch without a given expert's tokens leaves that
    expert with no gradient, so the tests can make an expert idle on every rank, or on some only."""

    def __init__(self, vocab_size: int = 67, dim: int = 16, n_experts: int = 4) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.wte = nn.Embedding(vocab_size, dim)
        self.router = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                     for _ in range(n_experts))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        gate = F.softmax(self.router(x).float(), dim=-1).to(x.dtype)
        choice = idx % self.n_experts
        mixed = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            chosen = choice == index
            if chosen.any():  # data-dependent: an expert no token chose is not run at all
                mixed[chosen] = expert(x[chosen]) * gate[chosen][:, index:index + 1]
        return self.head(self.ln_f(x + mixed))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; `tokens` is (B, T+1), logits come from tokens[:, :-1]."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """nanoGPT's split: matrices decay; biases, norms (all 1-D tensors) do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def seeded_init(model: nn.Module):
    """An initialisation that does not depend on the order modules are visited in: each module draws
    from a generator seeded by its name. Used to build the same model eagerly and on the meta device."""
    import zlib

    names = {module: name for name, module in model.named_modules()}

    def init(module: nn.Module) -> None:
        generator = torch.Generator().manual_seed(zlib.crc32(names[module].encode()))
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, nn.LayerNorm):
                param.data.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias":
                param.data.zero_()
            else:
                param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)

    return init


def small_zero_config(stage: int, **top) -> dict:
    """A config for TinyGPT tests on several ranks: small buckets (several per model), at stage 3 one unit per
    block and no persistent parameters, and a 30 s collective deadline so that a failing test fails fast."""
    zero = {"stage": stage, "reduce_bucket_bytes": 8192}
    if stage == 3:
        zero.update(stage3_min_unit_params=1000, stage3_param_persistence_threshold=0)
    return {"zero_optimization": zero, "comm_timeout_seconds": 30, **top}


def rank_batch(rank: int, step: int) -> torch.Tensor:
    """TinyGPT tokens (2 x 17) of `rank` at `step`, different on every rank and step."""
    return torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(100 * step + rank))
