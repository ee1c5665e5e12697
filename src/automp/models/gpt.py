"""A small GPT-style decoder: token + position embeddings, pre-LayerNorm blocks of causal self-attention and MLP.

Written the way users write it (F.scaled_dot_product_attention, tied head), so the demo exercises what automp
meets in real scripts: big matmuls to convert, LayerNorm and softmax statistics to keep FP32, a tied embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab: int = 128
    ctx: int = 64
    d: int = 128
    layers: int = 2
    heads: int = 4
    tie_head: bool = True

    def __post_init__(self) -> None:
        if self.d % self.heads:
            raise ValueError(f"GPTConfig: d={self.d} is not divisible by heads={self.heads}")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d), nn.LayerNorm(cfg.d)
        self.qkv, self.proj = nn.Linear(cfg.d, 3 * cfg.d), nn.Linear(cfg.d, cfg.d)
        self.fc, self.out = nn.Linear(cfg.d, 4 * cfg.d), nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok, self.pos = nn.Embedding(cfg.vocab, cfg.d), nn.Embedding(cfg.ctx, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        if cfg.tie_head:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits [batch, time, vocab] for token ids [batch, time]."""
        t = idx.shape[1]
        if t > self.cfg.ctx:
            raise ValueError(f"GPT: sequence of {t} tokens exceeds the context of {self.cfg.ctx}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
