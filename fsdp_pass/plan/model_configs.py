"""Built-in model configs: per-layer parameter shapes of public models, buildable as meta-device modules.

Shapes follow the Hugging Face module layout (``nn.Linear`` weights are ``(out_features, in_features)``):

* **Llama-3-8B** — hidden 4096, 32 layers, 32 heads, 8 KV heads, head_dim 128, FFN 14336,
  vocab 128256, untied embeddings. ~8.03B parameters.
* **Llama-3-70B** — hidden 8192, 80 layers, 64 heads, 8 KV heads, head_dim 128, FFN 28672,
  vocab 128256, untied embeddings. ~70.6B parameters.
* **GPT-OSS-120B** — 36 layers, hidden 2880, 64 heads, 8 KV heads, head_dim 64, attention biases and
  per-head sinks, a router with bias, 128 experts stored as FUSED tensors ``gate_up_proj``
  (128, 2880, 5760) and ``down_proj`` (128, 2880, 2880) plus their biases; vocab 201088, untied.
  ~116.8B parameters (the "117B" of the model card).
* **DeepSeek-V3** — 61 layers, hidden 7168, the first 3 dense (FFN 18432), then MoE with 256 routed
  experts (intermediate 2048) as SEPARATE per-expert tensors plus 1 shared expert and a router with
  its score-correction bias; MLA attention (q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
  qk_rope_head_dim 64, v_head_dim 128, 128 heads); vocab 129280, untied. ~671B parameters (the
  multi-token-prediction module, +14B, is not part of the 671B and is left out).

A model is a list of *units* — what one FSDP group (one ``fully_shard`` call) would hold: the
embedding, each transformer layer, and the head (final norm + output projection). Each unit is
``(unit_name, [(param_name, shape), ...])`` in first-use order. :func:`build_meta_model` turns the
tables into an ``nn.Module`` tree with exactly these parameter names and shapes on the meta device
(no forward: it is for planning), and :func:`load_model` also accepts a user's ``module:factory``.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

import torch
import torch.nn as nn

Shape = tuple[int, ...]
Param = tuple[str, Shape]
Unit = tuple[str, list[Param]]

__all__ = [
    "MODELS",
    "QUOTED_PARAMS",
    "TinyTransformer",
    "build_meta_model",
    "distinct_units",
    "load_model",
    "model_units",
    "representative_layer",
    "total_params",
    "unit_numel",
]


# ---------------------------------------------------------------------------------------------
# Llama 3
# ---------------------------------------------------------------------------------------------


def _llama3(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> list[Unit]:
    head_dim = hidden // heads
    units: list[Unit] = [("embed", [("embed_tokens.weight", (vocab, hidden))])]
    for i in range(layers):
        p = f"layers.{i}."
        units.append((f"layer{i}", [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (ffn, hidden)),
            (p + "mlp.up_proj.weight", (ffn, hidden)),
            (p + "mlp.down_proj.weight", (hidden, ffn)),
        ]))
    units.append(("head", [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]))
    return units


def llama3_8b() -> list[Unit]:
    return _llama3(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256)


def llama3_70b() -> list[Unit]:
    return _llama3(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256)


# ---------------------------------------------------------------------------------------------
# GPT-OSS-120B
# ---------------------------------------------------------------------------------------------


def gpt_oss_120b() -> list[Unit]:
    hidden, layers, heads, kv_heads, head_dim, experts, inter, vocab = 2880, 36, 64, 8, 64, 128, 2880, 201088
    units: list[Unit] = [("embed", [("embed_tokens.weight", (vocab, hidden))])]
    for i in range(layers):
        p = f"layers.{i}."
        units.append((f"layer{i}", [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.q_proj.bias", (heads * head_dim,)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.k_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "self_attn.o_proj.bias", (hidden,)),
            (p + "self_attn.sinks", (heads,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.router.weight", (experts, hidden)),
            (p + "mlp.router.bias", (experts,)),
            (p + "mlp.experts.gate_up_proj", (experts, hidden, 2 * inter)),
            (p + "mlp.experts.gate_up_proj_bias", (experts, 2 * inter)),
            (p + "mlp.experts.down_proj", (experts, inter, hidden)),
            (p + "mlp.experts.down_proj_bias", (experts, hidden)),
        ]))
    units.append(("head", [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]))
    return units


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3
# ---------------------------------------------------------------------------------------------


def deepseek_v3() -> list[Unit]:
    hidden, layers, dense_layers, vocab = 7168, 61, 3, 129280
    dense_ffn, moe_ffn, routed, shared = 18432, 2048, 256, 1
    q_lora, kv_lora, nope, rope, v_dim, heads = 1536, 512, 128, 64, 128, 128
    units: list[Unit] = [("embed", [("embed_tokens.weight", (vocab, hidden))])]
    for i in range(layers):
        p = f"layers.{i}."
        params: list[Param] = [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_a_proj.weight", (q_lora, hidden)),
            (p + "self_attn.q_a_layernorm.weight", (q_lora,)),
            (p + "self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora)),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden)),
            (p + "self_attn.kv_a_layernorm.weight", (kv_lora,)),
            (p + "self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_lora)),
            (p + "self_attn.o_proj.weight", (hidden, heads * v_dim)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
        if i < dense_layers:
            params += [
                (p + "mlp.gate_proj.weight", (dense_ffn, hidden)),
                (p + "mlp.up_proj.weight", (dense_ffn, hidden)),
                (p + "mlp.down_proj.weight", (hidden, dense_ffn)),
            ]
        else:
            params += [
                (p + "mlp.gate.weight", (routed, hidden)),
                (p + "mlp.gate.e_score_correction_bias", (routed,)),
            ]
            for e in range(routed):
                q = f"{p}mlp.experts.{e}."
                params += [
                    (q + "gate_proj.weight", (moe_ffn, hidden)),
                    (q + "up_proj.weight", (moe_ffn, hidden)),
                    (q + "down_proj.weight", (hidden, moe_ffn)),
                ]
            q = f"{p}mlp.shared_experts."
            params += [
                (q + "gate_proj.weight", (shared * moe_ffn, hidden)),
                (q + "up_proj.weight", (shared * moe_ffn, hidden)),
                (q + "down_proj.weight", (hidden, shared * moe_ffn)),
            ]
        units.append((f"layer{i}", params))
    units.append(("head", [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]))
    return units


MODELS: dict[str, Callable[[], list[Unit]]] = {
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "gpt-oss-120b": gpt_oss_120b,
    "deepseek-v3": deepseek_v3,
}

# Publicly quoted parameter counts, for self-checks.
QUOTED_PARAMS = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "gpt-oss-120b": 116.8e9, "deepseek-v3": 671e9}


def model_units(model: str) -> list[Unit]:
    """The units of ``model`` (a key of :data:`MODELS`), in execution order."""
    try:
        return MODELS[model]()
    except KeyError:
        raise ValueError(f"unknown model {model!r}; choose one of {sorted(MODELS)} or give module:factory") from None


def unit_numel(params: list[Param]) -> int:
    return sum(math.prod(shape) for _, shape in params)


def total_params(model: str) -> int:
    return sum(unit_numel(params) for _, params in model_units(model))


def distinct_units(model: str) -> list[tuple[str, list[Param], int]]:
    """Units with identical shape lists collapsed: ``(first unit name, params, how many units)``.

    Transformer layers repeat, so a whole-model figure is the sum over distinct units times their count.
    """
    seen: dict[tuple[Shape, ...], int] = {}
    out: list[tuple[str, list[Param], int]] = []
    for name, params in model_units(model):
        key = tuple(shape for _, shape in params)
        if key in seen:
            i = seen[key]
            out[i] = (out[i][0], out[i][1], out[i][2] + 1)
        else:
            seen[key] = len(out)
            out.append((name, params, 1))
    return out


def representative_layer(model: str) -> tuple[str, list[Param]]:
    """The transformer layer used for per-layer figures: the most common layer shape (MoE for DeepSeek-V3)."""
    layers = [u for u in distinct_units(model) if u[0].startswith("layer")]
    name, params, _ = max(layers, key=lambda u: u[2])
    return name, params


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


def build_meta_model(model: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """An ``nn.Module`` tree whose parameters have exactly ``model``'s names and shapes, on the meta device.

    ``layers.3.self_attn.q_proj.weight`` becomes parameter ``weight`` of submodule
    ``layers.3.self_attn.q_proj``. It has no forward: it exists to be planned and sharded.
    """
    root = nn.Module()
    for _, params in model_units(model):
        for name, shape in params:
            *path, leaf = name.split(".")
            owner = root
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            owner.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")))
    return root


def load_model(spec: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A built-in model by name, or ``module:factory`` (``factory()`` is called under ``torch.device("meta")``).

    The floating-point parameters of a user's model are cast to ``dtype``.
    """
    if ":" not in spec:
        return build_meta_model(spec, dtype)
    module_name, _, factory_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"cannot load {spec!r} ({e}); give module:factory with the module importable from the current "
            f"directory or PYTHONPATH, and factory a callable returning an nn.Module"
        ) from e
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model.to(dtype)


class TinyTransformer(nn.Module):
    """A two-layer pre-norm MLP transformer stand-in, small enough to trace in seconds (``explain``)."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"norm": nn.RMSNorm(dim), "up": nn.Linear(dim, 4 * dim), "down": nn.Linear(4 * dim, dim)})
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer["down"](torch.relu(layer["up"](layer["norm"](x))))
        return self.head(x)
