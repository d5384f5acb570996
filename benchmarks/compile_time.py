"""Compile time by model depth: where it goes, per system; ranks on a shared cache; a warm start.

    python benchmarks/compile_time.py                          # 2, 8, 16, 32 layers, every system
    python benchmarks/compile_time.py --layers 2 16 --systems fsdp_pass fsdp2_block
    python benchmarks/compile_time.py --scaling 8              # 1/2/4 ranks, shared cache off/on, at 8 layers
    python benchmarks/compile_time.py --warm 8                 # a second launch on the same cache (option off / on)

A llama-style model (dim 256, 8 heads, 4 KV heads, FFN 512, sequence 64, fp32, AdamW), 2 gloo ranks
pinned to a core each; every run is a fresh set of processes with an empty Inductor cache (except the
warm start, which keeps the first run's). Compile time = the first training step minus the second
(wall, rank 0; the table also gives the slowest rank). Its parts, from torch's own compile-time
counters and fsdp_pass's pass timings: Dynamo (tracing, guards), fsdp_pass passes 1-3b, AOTAutograd
(joint trace, partition, everything up to Inductor), Inductor (lowering, code generation, C++
builds; forward and backward). ``--hf-layers N`` adds Hugging Face's LlamaForCausalLM of that depth.

Systems: ``single`` one process, ``torch.compile(model)``; ``fsdp2_block`` FSDP2 with each block
compiled (torchtitan's recipe); ``fsdp_pass`` ``torch.compile(model, backend="vescale")``, the default
(repeated blocks compiled once); ``fsdp_pass_flat`` the same with ``compile_blocks_once=False``;
``fsdp_pass_block`` fsdp_pass with each block compiled. Writes ``benchmarks/results/compile_time.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from fsdp_pass.testing.spawn import run_distributed

SYSTEMS = ("single", "fsdp2_block", "fsdp_pass", "fsdp_pass_flat", "fsdp_pass_block")
PARTS = ("dynamo", "passes", "aot", "inductor")


def _model(kind: str, layers: int) -> tuple[torch.nn.Module, torch.Tensor, callable]:
    """(model, a batch of 2 sequences, loss of the model's output) with the same weights on every rank."""
    torch.manual_seed(0)
    if kind == "hf":
        from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

        cfg = HFConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg)
        tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
        return model, tokens, lambda m, x: m(input_ids=x, labels=x).loss
    from fsdp_pass.testing.models import Llama, LlamaConfig, lm_loss, random_tokens

    cfg = LlamaConfig(vocab=512, dim=256, layers=layers, heads=8, kv_heads=4, ffn=512, seq=64)
    return Llama(cfg), random_tokens(cfg, 2, 1), lambda m, x: lm_loss(m(x), x)


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.layers


def _build(system: str, model: torch.nn.Module, world: int, options: dict) -> torch.nn.Module:
    if system == "single":
        return torch.compile(model)
    if system == "fsdp2_block":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in _blocks(model):
            block.compile()
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    import fsdp_pass

    if system == "fsdp_pass_block":
        fsdp_pass.fully_shard(model, min_bucket_bytes=0)
        for block in _blocks(model):
            block.compile(backend="vescale", options=options)
        return model
    flat = {"compile_blocks_once": False} if system == "fsdp_pass_flat" else {}
    return torch.compile(model, backend="vescale", options={**options, **flat})


def _parts() -> dict[str, float]:
    """Seconds spent so far in each part, from torch's compile-time counters and the backend's records."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    total = {k: sum(v) for k, v in metrics.items()}
    inductor = total.get("compile_fx_inner", 0.0)
    # Inductor's forward compile runs inside AOTAutograd's dispatcher; its backward compile after it.
    aot = total.get("create_aot_dispatcher_function", 0.0) - total.get("compile_fx.<locals>.fw_compiler_base", 0.0)
    dynamo = total.get("_compile.compile_inner", 0.0) - total.get("OutputGraph.call_user_compiler", 0.0)
    passes = 0.0
    try:
        from fsdp_pass.compile.backend import records

        passes = sum(sum(r.seconds.values()) for r in records())
    except ImportError:
        pass
    return {"dynamo": dynamo, "passes": passes, "aot": max(aot, 0.0), "inductor": inductor}


def _rank(rank: int, world: int, system: str, kind: str, layers: int, cache: str, options: dict) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    model, tokens, loss_of = _model(kind, layers)
    model = _build(system, model, world, options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        loss_of(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
    return {"compile": seconds[0] - seconds[1], "step": seconds[1], **_parts()}


def measure(system: str, kind: str, layers: int, world: int, options: dict | None = None,
            cache: str | None = None) -> dict:
    """One fresh run (``world`` pinned ranks; ``single``: one process); its own empty cache unless ``cache``."""
    world = 1 if system == "single" else world
    with tempfile.TemporaryDirectory() as fresh:
        ranks = run_distributed(_rank, world, system, kind, layers, cache or fresh, options or {},
                                timeout=3600, pg_timeout=1800, pin_cores=True)
    row = {k: ranks[0][k] for k in ("compile", "step", *PARTS)}
    return {"system": system, "model": kind, "layers": layers, "ranks": world, **row,
            "slowest_rank_compile": max(r["compile"] for r in ranks)}


def _print(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'system':18s} {'model':6s} {'layers':>6s} {'ranks':>5s} {'compile s':>9s} {'slowest':>8s} "
          + " ".join(f"{p:>9s}" for p in PARTS))
    for r in rows:
        print(f"{r['system']:18s} {r['model']:6s} {r['layers']:6d} {r['ranks']:5d} {r['compile']:9.1f} "
              f"{r['slowest_rank_compile']:8.1f} " + " ".join(f"{r[p]:9.1f}" for p in PARTS))


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="*", default=[2, 8, 16, 32])
    ap.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--hf-layers", type=int, nargs="*", default=[], help="Hugging Face Llama depths to add")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--scaling", type=int, default=None, metavar="LAYERS",
                    help="fsdp_pass at this depth on 1, 2 and 4 ranks, shared_compile_cache off and on")
    ap.add_argument("--warm", type=int, default=None, metavar="LAYERS",
                    help="fsdp_pass at this depth launched twice on one cache (cold, then warm)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "compile_time.json")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    result: dict = {"meta": {"torch": torch.__version__, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}}

    depth = [measure(s, "llama", n, a.world) for n in a.layers for s in a.systems]
    depth += [measure(s, "hf", n, a.world) for n in a.hf_layers for s in a.systems]
    if depth:
        _print(depth, "compile time by depth (seconds)")
        result["depth"] = depth
    if a.scaling:
        scaling = [measure("fsdp_pass", "llama", a.scaling, world, {"shared_compile_cache": shared})
                   for world in (1, 2, 4) for shared in (False, True) if world > 1 or not shared]
        for r, shared in zip(scaling, (False, False, True, False, True)):
            r["system"] = "fsdp_pass shared" if shared else "fsdp_pass"
        _print(scaling, "ranks (2 cores: 4 ranks share them), shared_compile_cache off / on")
        result["scaling"] = scaling
    if a.warm:
        warm = []
        for shared in (False, True):
            with tempfile.TemporaryDirectory() as cache:
                runs = [measure("fsdp_pass", "llama", a.warm, a.world, {"shared_compile_cache": shared}, cache=cache)
                        for _ in range(2)]
            for r, launch in zip(runs, ("cold", "warm")):
                r["system"] = f"{launch}{' shared' if shared else ''}"
            warm += runs
        _print(warm, "a second launch on the same cache, shared_compile_cache off / on")
        result["warm"] = warm
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
