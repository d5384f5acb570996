"""Scale: trace full-size Llama-3-70B and DeepSeek-V3 on the meta device with Dynamo, then run the
``"vescale"`` backend's passes on the graph for 1024, 4096 and 16384 ranks of a fake process group.

    python benchmarks/scale.py                      # both models, 1024 / 4096 / 16384 ranks
    python benchmarks/scale.py --models llama3-70b --worlds 1024 --layers 2

For each model the forward (embedding, every layer, head and loss; tokens on the meta device too) is
traced once by ``torch.compile`` with a backend that only keeps Dynamo's graph. The graph does not
depend on the world size. Then, for each world size, fresh meta parameters of the same shapes are put
in the parameter slots, and the passes run as ``fsdp_pass.compile.backend.vescale`` chains them:

    fsdp_pass.compile.passes.pipeline.run_passes: detect ─ shard (mesh roles, blocks, plan, DBuffers, swap) ─ rewrite

The passes allocate nothing but this rank's shard of each bucket (on the CPU). The rewritten graph is
checked (one gather per bucket, no parameter placeholders left, ``graph.lint()``) and the per-rank memory
is read from the DBuffers. Writes ``benchmarks/results/scale.json``. Fails (exit 1) if the passes take
longer than ``--limit`` seconds for one configuration.

The models have the parameter names and shapes of ``fsdp_pass.plan.model_configs`` (checked) and a simple
forward: no rotary embedding, no KV cache; DeepSeek-V3's mixture of experts runs every expert on every
token, weighted by the top-8 gate (zero for experts not chosen), so the graph has no data-dependent
shapes and uses every expert's weights, as a training step does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
try:
    import fsdp_pass  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:
    sys.path.insert(0, str(HERE.parent))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from fsdp_pass.testing.fake_pg import fake_process_group  # noqa: E402
from fsdp_pass.testing.models import RMSNorm  # noqa: E402
from fsdp_pass.plan.model_configs import model_units  # noqa: E402
from fsdp_pass.options import Options  # noqa: E402
from fsdp_pass.compile.passes.detect import find_parameters  # noqa: E402
from fsdp_pass.compile.passes.pipeline import run_passes  # noqa: E402
from fsdp_pass.buckets.dbuffer import DBuffer  # noqa: E402
from fsdp_pass.buckets.gather import gather_bucket  # noqa: E402

MODELS = ("llama3-70b", "deepseek-v3")
WORLDS = (1024, 4096, 16384)
LIMIT_S = 60.0
ADAMW_STATES = 2  # exp_avg, exp_avg_sq: torch.optim.AdamW keeps them in the parameter's dtype


# ---------------------------------------------------------------------------------------------
# Models: model_configs' names and shapes, with a forward
# ---------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention (low-rank queries and keys/values)."""

    def __init__(self, hidden: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v_dim: int) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim, self.kv_lora = heads, nope, rope, v_dim, kv_lora
        self.q_a_proj = nn.Linear(hidden, q_lora, bias=False)
        self.q_a_layernorm = RMSNorm(q_lora)
        self.q_b_proj = nn.Linear(q_lora, heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora + rope, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora)
        self.kv_b_proj = nn.Linear(kv_lora, heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.heads, -1).transpose(1, 2)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.view(b, 1, t, self.rope).expand(b, self.heads, t, self.rope)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))


class MoE(nn.Module):
    """Sigmoid top-k routing with a score-correction bias, routed experts plus a shared expert.

    Every expert runs on every token, weighted by its gate (zero unless chosen). ``loop=False``
    (default) computes the routed experts as three batched products over their stacked weights;
    ``loop=True`` calls the expert modules one by one (eight graph nodes per expert instead of none).
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, scale: float, loop: bool = False) -> None:
        super().__init__()
        self.top_k, self.scale, self.loop = top_k, scale, loop
        self.gate = Router(hidden, experts)
        self.experts = nn.ModuleList(MLP(hidden, ffn) for _ in range(experts))
        self.shared_experts = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.linear(x, self.gate.weight).sigmoid()
        chosen = (scores + self.gate.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) * self.scale
        gate = torch.zeros_like(scores).scatter(-1, chosen, weights)
        out = self.shared_experts(x)
        if self.loop:
            for i, expert in enumerate(self.experts):
                out = out + gate[..., i : i + 1] * expert(x)
            return out
        w_gate = torch.stack([e.gate_proj.weight for e in self.experts])  # (experts, ffn, hidden)
        w_up = torch.stack([e.up_proj.weight for e in self.experts])
        w_down = torch.stack([e.down_proj.weight for e in self.experts])  # (experts, hidden, ffn)
        h = F.silu(torch.einsum("btd,efd->btef", x, w_gate)) * torch.einsum("btd,efd->btef", x, w_up)
        return out + torch.einsum("btef,edf,bte->btd", h, w_down, gate)


class Layer(nn.Module):
    def __init__(self, hidden: int, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def llama3_70b(layers: int = 80) -> CausalLM:
    hidden, heads, kv_heads, ffn, vocab = 8192, 64, 8, 28672, 128256
    return CausalLM(vocab, hidden, [Layer(hidden, GQAttention(hidden, heads, kv_heads), MLP(hidden, ffn))
                                    for _ in range(layers)])


def deepseek_v3(layers: int = 61, moe_loop: bool = False) -> CausalLM:
    hidden, dense_layers, vocab, dense_ffn, moe_ffn, routed = 7168, 3, 129280, 18432, 2048, 256
    mla = dict(heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v_dim=128)
    return CausalLM(vocab, hidden, [
        Layer(hidden, MLAttention(hidden, **mla),
              MLP(hidden, dense_ffn) if i < dense_layers
              else MoE(hidden, moe_ffn, routed, top_k=8, scale=2.5, loop=moe_loop))
        for i in range(layers)
    ])


BUILDERS = {"llama3-70b": llama3_70b, "deepseek-v3": deepseek_v3}


def build(model: str, layers: int | None = None, dtype: torch.dtype = torch.float32, **kwargs) -> CausalLM:
    """``model`` on the meta device; ``layers`` keeps the first layers only (default: all).

    Raises unless the parameter names and shapes are those of ``fsdp_pass.plan.model_configs`` (its
    embedding, head and first ``layers`` layers).
    """
    with torch.device("meta"):
        built = BUILDERS[model](**({} if layers is None else {"layers": layers}), **kwargs)
    built.to(dtype)
    n = len(built.layers)
    expected = sorted(p for unit, params in model_units(model)
                      if unit in ("embed", "head") or int(unit.removeprefix("layer")) < n for p in params)
    got = sorted((name, tuple(p.shape)) for name, p in built.named_parameters())
    if got != expected:
        raise AssertionError(f"{model}: parameters differ from fsdp_pass.plan.model_configs: "
                             f"{sorted(set(got) ^ set(expected))[:5]}")
    return built


# ---------------------------------------------------------------------------------------------
# Dynamo capture and the passes
# ---------------------------------------------------------------------------------------------


@dataclass
class Captured:
    gm: fx.GraphModule  # Dynamo's graph, never modified (the rewrite works on a copy)
    example_inputs: list  # the model's parameters (meta) and the tokens, in placeholder order
    names: dict[int, str]  # placeholder position → the parameter's name in the model, taken inside Dynamo's call
    seconds: float


def capture(model: nn.Module, batch: int = 1, seq: int = 8) -> Captured:
    """Dynamo's graph of ``model``'s forward on meta tokens (one graph, no breaks)."""
    graphs: list[tuple[fx.GraphModule, list, dict[int, str]]] = []

    def keep(gm: fx.GraphModule, example_inputs: list):  # a backend that only keeps the graph and the names
        names = {s.index: s.name for s in find_parameters(gm, example_inputs)}
        graphs.append((gm, list(example_inputs), names))
        return gm.forward

    torch._dynamo.reset()
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    started = time.perf_counter()
    torch.compile(model, backend=keep, fullgraph=True)(tokens)
    seconds = time.perf_counter() - started
    (gm, inputs, names), = graphs
    torch._dynamo.reset()  # the graph is ours now; Dynamo's caches can go
    return Captured(gm, inputs, names, seconds)


def fresh_parameters(example_inputs: list) -> list:
    """The example inputs with every parameter replaced by a new meta parameter of the same shape.

    The shard pass swaps the parameters it is given into RaggedShard parameters in place, so each
    world size gets its own; Dynamo's graph does not depend on them.
    """
    return [nn.Parameter(torch.empty(x.shape, dtype=x.dtype, device="meta"), requires_grad=x.requires_grad)
            if isinstance(x, nn.Parameter) else x for x in example_inputs]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_passes(captured: Captured, options: dict) -> dict:
    """The backend's passes on ``captured`` under the current (fake) process group, timed and checked.

    Returns ``{"seconds", "checks", "memory", "rewritten", "sites"}``; ``checks`` are counted from
    the rewritten graph, ``memory`` from its DBuffers (:func:`per_rank_memory`).
    """
    # The checks read the rewritten graph as the rewrite leaves it: repeated blocks not outlined
    # (compile time, which outlining is for, is compile_time.py's).
    opts = Options.from_dict({"compile_blocks_once": False, **options})
    inputs = fresh_parameters(captured.example_inputs)
    rss = _rss_bytes()
    result = run_passes(captured.gm, inputs, opts, names=captured.names)
    rss_growth = _rss_bytes() - rss
    sites, new, rewritten = result.sites, result.sharded.new, result.rewritten

    graph = rewritten.gm.graph
    graph.lint()
    gathers = list(graph.find_nodes(op="call_function", target=gather_bucket))
    shard_inputs = {f"bucket{i}_shard" for i in range(len(rewritten.buffers))}
    parameter_nodes = {s.node.name for s in sites}
    views = [v for g in gathers for split in g.users for item in split.users for v in item.users]
    checks = {
        "parameters": len(sites),
        "buckets": len(new),
        "gathers": len(gathers),
        "one_gather_per_bucket": len(gathers) == len(rewritten.buffers) == len(new)
        and {g.args[0].name for g in gathers} == shard_inputs,
        "parameter_views": len(views),
        "parameter_placeholders_left": sum(n.name in parameter_nodes for n in graph.find_nodes(op="placeholder")),
        "graph_nodes": len(graph.nodes),
    }
    return {
        "seconds": {**result.seconds, "passes": sum(result.seconds.values())},
        "checks": checks,
        "memory": per_rank_memory(rewritten.buffers, opts.param_dtype),
        "host_rss_growth": rss_growth,
        "rewritten": rewritten,
        "sites": sites,
    }


def _padding_per_rank(buf: DBuffer) -> dict[int, int]:
    """Padding elements of ``buf`` on each rank that holds any."""
    S, pos, out = buf.layout.shard_size, 0, {}
    for name, size in buf.layout.segments():
        if name is None and size:
            for rank in range(pos // S, (pos + size - 1) // S + 1):
                out[rank] = out.get(rank, 0) + min(pos + size, (rank + 1) * S) - max(pos, rank * S)
        pos += size
    return out


def per_rank_memory(buffers: list[DBuffer], param_dtype: torch.dtype | None) -> dict:
    """What one rank holds, from the DBuffers (every rank holds ``S`` elements of every bucket).

    Parameters and gradients: the bucket shards, padding included (it is allocated). AdamW's two
    states: ``torch.optim.AdamW`` allocates them per local piece in the parameter's dtype, so they
    cover the rank's real elements only; the busiest rank (least padding) is reported. Largest
    gathered bucket: one bucket's global buffer in the gather dtype; with prefetching two can be
    live at once (``total`` counts two). Activations are not included.
    """
    world = buffers[0].mesh.shard_size
    params = sum(b.layout.shard_size * b.dtype.itemsize for b in buffers)
    trainable = [b for b in buffers if b.shard.requires_grad]
    grads = sum(b.layout.shard_size * b.dtype.itemsize for b in trainable)
    padding: dict[int, int] = {}
    for b in trainable:
        for rank, n in _padding_per_rank(b).items():
            padding[rank] = padding.get(rank, 0) + n * b.dtype.itemsize
    least_padding = min(padding.values()) if len(padding) == world else 0
    adamw = ADAMW_STATES * (grads - least_padding)
    largest = max(buffers, key=lambda b: b.layout.global_size)
    gathered = largest.layout.global_size * (param_dtype or largest.dtype).itemsize
    return {
        "world_size": world,
        "params": params,
        "grads": grads,
        "adamw": adamw,
        "largest_gathered_bucket": gathered,
        "total": params + grads + adamw + 2 * gathered,
        "elements": sum(b.layout.numel for b in buffers),
        "padding_elements": sum(b.layout.padding for b in buffers),
        "shard_elements": sum(b.layout.shard_size for b in buffers),
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f}"


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(BUILDERS))
    parser.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS))
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--moe-loop", action="store_true", help="DeepSeek-V3: call the experts one by one")
    parser.add_argument("--bucket-size", type=int, default=None, help="options['bucket_size'] (elements)")
    parser.add_argument("--limit", type=float, default=LIMIT_S, help="seconds allowed for the passes (default 60)")
    parser.add_argument("--out", default=str(HERE / "results" / "scale.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    options = {"mp_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
               "bucket_size": args.bucket_size}

    rows = []
    header = (f"{'model':12s} {'ranks':>6s} {'trace s':>8s} {'passes s':>9s} {'(detect':>8s} {'shard':>6s} "
              f"{'rewrite)':>8s} {'buckets':>7s} {'gathers':>7s} {'params GiB':>10s} {'grads':>7s} {'AdamW':>7s} "
              f"{'gather GiB':>10s} {'total GiB':>9s}  result")
    for name in args.models:
        started = time.perf_counter()
        model = build(name, args.layers, **({"moe_loop": True} if args.moe_loop and name == "deepseek-v3" else {}))
        built = time.perf_counter() - started
        params = sum(p.numel() for p in model.parameters())
        captured = capture(model)
        print(f"{name}: {params / 1e9:.2f}B parameters in {sum(1 for _ in model.parameters()):,} tensors, built on "
              f"meta in {built:.1f} s; Dynamo graph of {len(captured.gm.graph.nodes):,} nodes traced in "
              f"{captured.seconds:.1f} s", flush=True)
        for world in args.worlds:
            with fake_process_group(world):
                result = timed_passes(captured, dict(options, mesh=init_device_mesh("cpu", (world,))))
                del result["rewritten"], result["sites"]
            gc.collect()  # the sharded parameters and their DBuffers reference each other
            s, c, m = result["seconds"], result["checks"], result["memory"]
            ok = (s["passes"] <= args.limit and c["one_gather_per_bucket"] and c["parameter_placeholders_left"] == 0
                  and c["parameter_views"] == c["parameters"] and m["elements"] == params
                  and m["shard_elements"] * world == m["elements"] + m["padding_elements"])
            rows.append({"model": name, "layers": len(model.layers), "params": params, "world_size": world,
                         "moe_loop": args.moe_loop, "trace_seconds": captured.seconds, "limit_seconds": args.limit,
                         "ok": ok, **result, "options": {"bucket_size": args.bucket_size, "param_dtype": "bfloat16",
                                                         "reduce_dtype": "float32", "master_dtype": "float32"}})
            if len(rows) == 1 or rows[-2]["model"] != name:
                print(header)
            print(f"{name:12s} {world:6d} {captured.seconds:8.1f} {s['passes']:9.1f} {s['detect']:8.1f} "
                  f"{s['shard']:6.1f} {s['rewrite']:8.1f} {c['buckets']:7d} {c['gathers']:7d} {_gib(m['params']):>10s} "
                  f"{_gib(m['grads']):>7s} {_gib(m['adamw']):>7s} {_gib(m['largest_gathered_bucket']):>10s} "
                  f"{_gib(m['total']):>9s}  {'ok' if ok else 'FAIL'}", flush=True)
        del model, captured
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
