"""Soak: train the main job's model for many steps, sampling memory and compiles every 50 steps.

``torchrun --standalone --nproc-per-node 2 benchmarks/soak.py [--steps 500] [--compiler aot_eager]``

Prints one row per sample (resident memory of every rank, backend compiles so far, Dynamo frame
compiles) and writes benchmarks/results/soak.json. Memory should stay flat after warm-up, and no
compile should happen after the first steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train  # noqa: E402  (the main job's model and data)

import fsdp_pass  # noqa: E402
from fsdp_pass.compile.backend import records  # noqa: E402


def resident_bytes() -> int:
    """Current (not peak) resident set size of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--compiler", choices=["inductor", "aot_eager"], default="aot_eager")
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    cfg = train.ModelConfig()
    torch.manual_seed(0)
    model = train.Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="vescale", options={"compiler": args.compiler})
    data, _, _ = train.load_corpus(max_bytes=4_000_000)
    per_rank, batch = 8 // world, 8
    samples, started = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = train.global_batch(data, batch, cfg.seq, seed=step)[rank * per_rank:(rank + 1) * per_rank]
        loss = train.lm_loss(compiled(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % args.every == 0 or step == 1:
            counts = torch.tensor([resident_bytes(), len(records()),
                                   torch._dynamo.utils.counters["stats"]["unique_graphs"]], dtype=torch.float64)
            every = [torch.zeros_like(counts) for _ in range(world)]
            dist.all_gather(every, counts)
            sample = {"step": step, "loss": loss.item(), "seconds": time.perf_counter() - started,
                      "rss_mib": [t[0].item() / 2**20 for t in every],
                      "backend_compiles": int(every[0][1]), "dynamo_graphs": int(every[0][2])}
            samples.append(sample)
            if rank == 0:
                print(f"step {step:4d}  loss {sample['loss']:.3f}  rss MiB " +
                      " ".join(f"{m:7.1f}" for m in sample["rss_mib"]) +
                      f"  compiles {sample['backend_compiles']}  graphs {sample['dynamo_graphs']}", flush=True)
    if rank == 0:
        after_warmup = [s for s in samples if s["step"] >= 2 * args.every]
        growth = [max(s["rss_mib"][r] for s in after_warmup) - min(s["rss_mib"][r] for s in after_warmup)
                  for r in range(world)] if after_warmup else []
        compiles_after = samples[-1]["backend_compiles"] - samples[1]["backend_compiles"] if len(samples) > 1 else 0
        summary = {"args": vars(args), "world": world, "samples": samples,
                   "rss_growth_after_warmup_mib": growth, "compiles_after_first_sample": compiles_after}
        print(f"RSS range after step {2 * args.every} per rank (MiB): {[round(g, 1) for g in growth]}; "
              f"backend compiles after step {samples[1]['step'] if len(samples) > 1 else '-'}: {compiles_after}")
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
