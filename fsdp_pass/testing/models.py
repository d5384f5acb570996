"""Reference models for the tests and benchmarks: an MLP and a small llama-style transformer.

The transformer (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) has a dense feed-forward
or a mixture of experts. Every MoE variant computes every expert on every token, weighted by a top-k
softmax gate (zero for unchosen experts): static shapes and no data-dependent routing, so one graph
compiles without breaks, at ``experts / top_k`` times the FLOPs of a sparse MoE.
"""

from __future__ import annotations

import functools
import io
import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


__all__ = [
    "MLP", "LlamaConfig", "RMSNorm", "rope", "Attention", "SwiGLU", "MoE", "StackedMoE", "Block", "Llama",
    "lm_loss", "init_std", "random_tokens", "GRAPH_BREAKS", "BreakingStack", "tiny_hf_llama",
    "Checkpointed",
]


class MLP(nn.Module):
    """Linear layers of widths ``dims`` with ReLU between them."""

    def __init__(self, dims: Sequence[int] = (19, 37, 23, 5)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


@dataclass
class LlamaConfig:
    """Sizes and variants of :class:`Llama` (the defaults are the tests' tiny model)."""

    vocab: int = 61
    dim: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 48
    seq: int = 8
    experts: int = 0  # > 0: mixture-of-experts feed-forward
    top_k: int = 2
    stacked_experts: bool = False  # experts as 3-D weights (StackedMoE, expert parallel) instead of modules
    batched_experts: bool = False  # with stacked_experts: one batched product per weight, not a loop over experts
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.batched_experts and not self.stacked_experts:
            raise ValueError("batched_experts computes stacked experts: set stacked_experts=True too")


class RMSNorm(nn.Module):
    """Root-mean-square normalization over the last dimension, with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding: rotate pairs of ``x``'s last dimension by the angles ``freqs``."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank has heads / tp of them.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = rope(q, freqs), rope(k, freqs)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """The gated feed-forward ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed experts as :class:`SwiGLU` modules, computed densely (every expert on every token, weighted)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.dim, cfg.ffn) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        gate = torch.zeros_like(scores).scatter(-1, chosen, weights)
        return sum(gate[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


class Block(nn.Module):
    """One transformer layer: pre-norm attention and pre-norm feed-forward (dense or MoE), both residual."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        if cfg.experts:
            self.ffn = StackedMoE(cfg) if cfg.stacked_experts else MoE(cfg)
        else:
            self.ffn = SwiGLU(cfg.dim, cfg.ffn)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), freqs)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """A llama-style decoder: token embedding, ``cfg.layers`` blocks, final norm, output head (logits)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        head_dim = cfg.dim // cfg.heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("freqs", torch.outer(torch.arange(cfg.seq).float(), inv), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        freqs = self.freqs[: tokens.shape[1], None, :]
        for layer in self.layers:
            x = layer(x, freqs)
        return self.output(self.norm(x))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``logits`` for ``tokens`` (each position predicts the next token)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def init_std(model: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic, scale-aware initialisation independent of module construction order.

    Every parameter of two or more dimensions is drawn, in ``named_parameters`` order, from a generator
    seeded with ``seed`` and scaled by ``1 / sqrt(fan_in)``; the others keep their values. Returns ``model``.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def random_tokens(cfg: LlamaConfig, batch: int, seed: int) -> torch.Tensor:
    """A ``(batch, cfg.seq)`` batch of token ids drawn from a generator seeded with ``seed``."""
    return torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=torch.Generator().manual_seed(seed))


class StackedMoE(nn.Module):
    """Top-k routed experts with stacked weights ``(experts, out, in)``, computed densely.

    Under expert parallelism the weights are DTensors split ``Shard(0)`` over an EP mesh: each EP
    rank gathers the tokens of its EP group, applies its own experts, and the partial outputs are
    reduce-scattered back to the tokens' ranks. With ``cfg.batched_experts`` (plain tensors only) the
    experts are computed by one batched product per weight instead of a loop over the experts.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.top_k, self.batched = cfg.top_k, cfg.batched_experts
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(cfg.experts, cfg.ffn, cfg.dim) / math.sqrt(cfg.dim))
        self.w3 = nn.Parameter(torch.randn(cfg.experts, cfg.ffn, cfg.dim) / math.sqrt(cfg.dim))
        self.w2 = nn.Parameter(torch.randn(cfg.experts, cfg.dim, cfg.ffn) / math.sqrt(cfg.ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        scores = self.router(x).softmax(-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        gate = torch.zeros_like(scores).scatter(-1, chosen, weights)
        if self.batched:
            return self._batched(x, gate)
        w1, w2, w3 = self.w1, self.w2, self.w3
        first = 0
        if isinstance(w1, DTensor):  # expert parallel: this rank's experts on the EP group's tokens
            mesh = w1.device_mesh
            gather = lambda t: DTensor.from_local(t, mesh, [Shard(0)]).redistribute(  # noqa: E731
                mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            x, gate = gather(x), gather(gate)
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
            first = mesh.get_local_rank() * w1.shape[0]
        out = sum(
            gate[..., first + e : first + e + 1] * F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e])
            for e in range(w1.shape[0])
        )
        if isinstance(self.w1, DTensor):
            out = DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local()
        return out

    def _batched(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Every expert on every token as batched products over the stacked weights, summed by ``gate``."""
        b, s, d = x.shape
        t = x.reshape(1, b * s, d)
        h = F.silu(torch.matmul(t, self.w1.transpose(1, 2))) * torch.matmul(t, self.w3.transpose(1, 2))
        y = torch.matmul(h, self.w2.transpose(1, 2))  # (experts, b * s, d)
        return torch.einsum("etd,te->td", y, gate.reshape(b * s, -1)).view(b, s, d)


class Checkpointed(nn.Module):
    """``module`` under activation checkpointing (``torch.utils.checkpoint``), recomputed whole in backward
    (early stop off: the recompute runs to the module's end, as a module with a side effect after its last
    saved tensor does). ``selective``: torchtitan's selective checkpointing, the matrix products saved, the
    rest recomputed (non-reentrant only), which refuses a recompute that runs an op the forward did not."""

    def __init__(self, module: nn.Module, reentrant: bool = False, selective: bool = False) -> None:
        super().__init__()
        self.module = module
        self.reentrant = reentrant
        self.selective = selective

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        kwargs = {}
        if self.selective:
            kwargs["context_fn"] = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
                                                     [torch.ops.aten.mm.default])
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=self.reentrant, **kwargs)


# -- models whose forward Dynamo cannot trace whole ([Note: parameters no graph reads]) -----------

GRAPH_BREAKS = ("print", "logging", "item", "branch", "checkpoint")
_graph_break_log = logging.getLogger("fsdp_pass.testing.graph_break")
_printed = io.StringIO()  # where the "print" block prints


class _BreakingBlock(nn.Module):
    """``a`` → ReLU → one of :data:`GRAPH_BREAKS` → ``b`` (and ``c`` when the branch is taken).

    Column 0 of the input is a flag every sample of a step shares: the ``.item()`` scale and the
    branch read it, so every rank (and one process on the whole batch) computes the same.
    """

    def __init__(self, kind: str, dim: int) -> None:
        super().__init__()
        if kind not in GRAPH_BREAKS:
            raise ValueError(f"unknown graph break {kind!r}; one of {GRAPH_BREAKS}")
        self.kind = kind
        self.a, self.b, self.c = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.calls = 0  # the checkpointed function's side effect

    def _checkpointed(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a side effect Dynamo refuses inside torch.utils.checkpoint
        return self.b(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        if self.kind == "print":
            print("block input", tuple(h.shape), file=_printed)
        elif self.kind == "logging":
            _graph_break_log.debug("block input %s", tuple(h.shape))
        elif self.kind == "item":
            h = h * (1.0 + x[0, 0].item())
        elif self.kind == "branch" and x[:, 0].sum() > 0:  # not taken while the flag is 0
            h = self.c(h)
        if self.kind == "checkpoint":
            return torch.utils.checkpoint.checkpoint(self._checkpointed, h, use_reentrant=False)
        return self.b(h)


class BreakingStack(nn.Module):
    """An input layer, ``layers`` blocks that graph-break with ``kind`` (called in a loop, so Dynamo
    gives up on this frame and compiles each block's frame on its own) and an output layer."""

    def __init__(self, kind: str, dim: int = 12, layers: int = 2, out: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_BreakingBlock(kind, dim) for _ in range(layers))
        self.out = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x[:, :1], self.inp(x)[:, 1:]], dim=1)  # keep the flag column
        for block in self.blocks:
            h = torch.cat([x[:, :1], block(h)[:, 1:]], dim=1)
        return self.out(h)


def tiny_hf_llama(layers: int = 2, vocab: int = 61, tie_word_embeddings: bool = False,
                  gradient_checkpointing: bool = False) -> nn.Module:
    """transformers' ``LlamaForCausalLM`` from a tiny config (no download), optionally with Hugging Face
    gradient checkpointing (non-reentrant, as fine-tuning recipes set it)."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    cfg = HFLlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                        tie_word_embeddings=tie_word_embeddings, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
