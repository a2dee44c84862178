"""A Llama-shaped decoder for throughput (issue 34, item 5): RMSNorm, rotary positions, grouped-query attention
through torch's scaled_dot_product_attention (flash attention on a GPU), a SwiGLU MLP, no biases, an untied head.
The default shape is Llama 3.2 1B's body (hidden 2048, 16 layers, 32 query and 8 key-value heads, MLP 8192) with
Llama 2's 32,000-token vocabulary: 1.10B parameters. Like the benchmarks' GPT it keeps its blocks in `blocks`, which
FSDP2 shards one by one and zerokit's stage 3 makes its units.

Training FLOPs per token, as the MFU of PaLM (Chowdhery et al. 2022, appendix B) and torchtitan count them:
6 x parameters (less the embedding's, a lookup) for the matrix products, plus 6 x layers x hidden x sequence for
the attention scores and their use (12 L h T, halved by the causal mask that flash attention skips).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32_000
    hidden: int = 2048
    n_layer: int = 16
    n_head: int = 32
    n_kv_head: int = 8
    mlp_hidden: int = 8192
    rope_theta: float = 500_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) by position, the halves-split form Llama's reference code uses; computed per
    call (no buffer: the model builds on the meta device too)."""
    time, half = x.size(2), x.size(3) // 2
    frequencies = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(time, device=x.device, dtype=torch.float32), frequencies)  # (T, half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        kv = config.n_kv_head * config.head_dim
        self.q = nn.Linear(config.hidden, config.hidden, bias=False)
        self.k = nn.Linear(config.hidden, kv, bias=False)
        self.v = nn.Linear(config.hidden, kv, bias=False)
        self.o = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        c = self.config
        # (B, heads, T, head_dim)
        q = self.q(x).view(batch, time, c.n_head, c.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, time, c.n_kv_head, c.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, time, c.n_kv_head, c.head_dim).transpose(1, 2)
        q, k = rotary(q, c.rope_theta), rotary(k, c.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(batch, time, c.hidden))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden, eps=1e-5)
        self.attention = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden, eps=1e-5)
        self.gate = nn.Linear(config.hidden, config.mlp_hidden, bias=False)
        self.up = nn.Linear(config.hidden, config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.hidden, eps=1e-5)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        for name, param in self.named_parameters():
            if param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def flops_per_token(model: Llama, seq_len: int) -> float:
    """Training FLOPs per token (See the module's docstring)."""
    c = model.config
    dense = sum(p.numel() for p in model.parameters()) - model.embed.weight.numel()
    return 6 * dense + 6 * c.n_layer * c.hidden * seq_len
