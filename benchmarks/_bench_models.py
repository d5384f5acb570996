"""Models for ``step_time.py``: a llama-style dense transformer and a mixture-of-experts variant.

Copied from the design of ``tests/models.py`` (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU) so that the benchmark does not depend on the test tree. The MoE feed-forward keeps its experts
as three stacked 3-D parameters ``(experts, ...)`` and computes every expert on every token, weighted
by a top-k softmax gate (zero for unchosen experts): static shapes, no data-dependent routing, so
every system compiles one graph without graph breaks. It costs ``experts / top_k`` times the FLOPs
of a sparse MoE; all systems pay the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 4096
    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 704
    seq: int = 128
    experts: int = 0  # > 0: mixture-of-experts feed-forward
    top_k: int = 2


# Sizes chosen so that one run of every system (compile included) fits in about 10 minutes on two
# loaded cores; ``--quick`` is for checking that everything runs.
CONFIGS = {
    "llama": ModelConfig(vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, ffn=704, seq=128),
    "moe": ModelConfig(vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, ffn=256, seq=128, experts=4, top_k=2),
}
QUICK_CONFIGS = {
    "llama": ModelConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=176, seq=32),
    "moe": ModelConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=64, seq=32, experts=4, top_k=2),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = rope(q, freqs), rope(k, freqs)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k gated experts, stacked ``(E, out, in)`` weights, every expert computed on every token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.experts, cfg.ffn, cfg.dim))
        self.w3 = nn.Parameter(torch.empty(cfg.experts, cfg.ffn, cfg.dim))
        self.w2 = nn.Parameter(torch.empty(cfg.experts, cfg.dim, cfg.ffn))

    def forward(self, x):
        b, s, d = x.shape
        scores = self.router(x).softmax(-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        gate = torch.zeros_like(scores).scatter(-1, chosen, weights)  # (b, s, E)
        t = x.reshape(1, b * s, d)
        h = F.silu(torch.matmul(t, self.w1.transpose(1, 2))) * torch.matmul(t, self.w3.transpose(1, 2))
        y = torch.matmul(h, self.w2.transpose(1, 2))  # (E, b*s, d)
        return torch.einsum("etd,te->td", y, gate.reshape(b * s, -1)).view(b, s, d)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.ffn = MoE(cfg) if cfg.experts else SwiGLU(cfg.dim, cfg.ffn)

    def forward(self, x, freqs):
        x = x + self.attn(self.attn_norm(x), freqs)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        head_dim = cfg.dim // cfg.heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("freqs", torch.outer(torch.arange(cfg.seq).float(), inv), persistent=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        freqs = self.freqs[: tokens.shape[1], None, :]
        for layer in self.layers:
            x = layer(x, freqs)
        return self.output(self.norm(x))


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """The model with deterministic weights (same on every rank and for every system)."""
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch(cfg: ModelConfig, per_rank_batch: int, rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s tokens for ``step`` (its own slice of a seeded global batch)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, cfg.vocab, (per_rank_batch, cfg.seq), generator=g)
