"""GPU check: fsdp_pass (Inductor, bf16) against FSDP2 at world size 1 on NCCL, one process.

At world size 1 FSDP2 still copies parameters in and out of its flat buffers every step, while
fsdp_pass's parameters are views of the (here trivially) gathered bucket. First checks numerics:
one fp32 step of fsdp_pass compiled by Inductor against the same model run eagerly (TF32 off), loss
and every gradient. Then reports median step time, peak CUDA memory and the NCCL/CUDA environment
for bf16 mixed precision; writes JSON. One process has no communication to order or overlap: the
multi-rank schedule is checked on CPU (tests/test_schedule.py) until several GPUs are available. Runs as
``torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py`` (see gpu_check.sh);
``--device cpu`` runs the same code on gloo for a dry run without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_pass


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.gate, self.down = (nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False),
                                         nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _fsdp2(model: nn.Module, device: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _measure(name: str, model: nn.Module, args, device: str) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, losses = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"system": name, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "max_ms": 1e3 * max(times), "peak_bytes": peak, "last_loss": losses[-1]}


def _numerics(base: nn.Module, args, device: str) -> dict:
    """One fp32 forward/backward: fsdp_pass + Inductor against eager, same tokens; worst relative differences."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    losses, grads = [], []
    for model in (copy.deepcopy(base), torch.compile(copy.deepcopy(base), backend="vescale",
                                                     options={"compiler": "inductor"})):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.detach())
        grads.append([fsdp_pass.interop.state_dict.whole_tensor(p.grad) if hasattr(p.grad, "full_tensor") else p.grad
                      for p in getattr(model, "_orig_mod", model).parameters()])

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()

    return {"loss_rel": rel(losses[1], losses[0]), "grad_rel": max(rel(a, b) for a, b in zip(grads[1], grads[0]))}


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/gpu_check.json")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    torch.manual_seed(0)
    base = Model(args.vocab, args.dim, args.layers, args.heads).to(device)
    numerics = _numerics(base, args, device)
    print(f"Inductor vs eager, fp32, one step: loss rel diff {numerics['loss_rel']:.2e}, "
          f"worst gradient rel diff {numerics['grad_rel']:.2e} (ok below 1e-4)")
    results = []
    fsdp2 = _fsdp2(copy.deepcopy(base), device)
    results.append(_measure("FSDP2 eager (bf16)", fsdp2, args, device))
    del fsdp2
    ours = torch.compile(copy.deepcopy(base), backend="vescale", options={
        "compiler": "inductor", "mp_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}})
    results.append(_measure("fsdp_pass inductor (bf16)", ours, args, device))
    reference = results[0]["median_ms"]
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"NCCL {torch.cuda.nccl.version() if device == 'cuda' else '-'}")
    print(f"{'system':28s} {'median ms':>10s} {'min-max ms':>16s} {'peak MiB':>10s} {'ratio':>7s} {'loss':>8s}")
    for r in results:
        peak = f"{r['peak_bytes'] / 2**20:.0f}" if r["peak_bytes"] is not None else "-"
        print(f"{r['system']:28s} {r['median_ms']:10.1f} {r['min_ms']:7.1f}-{r['max_ms']:<8.1f} {peak:>10s} "
              f"{r['median_ms'] / reference:7.2f} {r['last_loss']:8.4f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "numerics": numerics, "results": results}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
