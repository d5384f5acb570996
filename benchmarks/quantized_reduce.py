"""Block-quantized gradient reduction (``options["quantized_reduce"]``): its error, its bytes, its convergence.

Three measurements ([Note: block-quantized gradient reduction] in fsdp_pass/buckets/quantized_reduce.py):

* ``error``: on ``--world-size`` gloo ranks (default 4), two compiled copies of one llama (dim 128,
  4 layers; aot_eager) take the same batches: one reduces gradients exactly (fp32), the other
  block-quantized (round to nearest, then stochastic, each its own run). After each backward the
  relative error of every bucket's reduced gradient, ``||g_q - g|| / ||g||`` over the whole bucket,
  is recorded; then the quantized copy's gradients are replaced by the exact ones, so both step alike
  and the error is measured along the exact run's trajectory (``--error-steps`` steps).
* ``bytes``: one profiled step per reduction (fp32, bf16 ``reduce_dtype``, int8 blocks): the bytes each
  rank sends to the others in the gradient reduction (reduce_scatter: (g-1)/g of its input; the
  quantized all_to_all: the rows for the g-1 others), from the profiler's records of what ran.
* ``convergence``: ``examples/train.py`` (llama on the standard-library corpus) on 2 ranks for
  ``--steps`` steps and ``--seeds`` seeds, exact and quantized (each rounding); the final loss (mean of the last 10
  steps) of the quantized runs against the seed-to-seed spread of the exact ones; curves plotted to
  ``docs/img/quantized_reduce_convergence.png``.

Run: ``python benchmarks/quantized_reduce.py [--only error|bytes|convergence]``; prints tables, writes
``benchmarks/results/quantized_reduce.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fsdp_pass  # noqa: E402
from fsdp_pass.buckets.dbuffer import buffers_of  # noqa: E402
from fsdp_pass.tensor import in_flight  # noqa: E402
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss  # noqa: E402
from fsdp_pass.testing.spawn import run_distributed  # noqa: E402

MODEL = dict(vocab=512, dim=128, ffn=384, layers=4, heads=4, kv_heads=4, seq=32)
BLOCK = 128
REDUCTIONS = {  # label -> backend options
    "fp32": {},
    "bf16 reduce_dtype": {"mp_policy": {"param_dtype": torch.float32, "reduce_dtype": torch.bfloat16}},
    "int8 blocks, nearest": {"quantized_reduce": {"bits": 8, "block": BLOCK, "rounding": "nearest"}},
    "int8 blocks, stochastic": {"quantized_reduce": {"bits": 8, "block": BLOCK, "rounding": "stochastic"}},
}
_ELEMENT_SIZES = {"float": 4, "c10::BFloat16": 2, "unsigned char": 1}


def _compiled(mesh, options: dict):
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig(**MODEL)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.compile(model, backend="vescale", options={
        "mesh": mesh, "compiler": "aot_eager", "min_bucket_bytes": 0, **options})


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    tokens = torch.randint(0, MODEL["vocab"], (4 * world, MODEL["seq"]), generator=torch.Generator().manual_seed(step))
    return tokens.chunk(world)[rank]


def _errors(rank: int, world: int, steps: int) -> dict:
    """Per reduction: per step, per bucket, the relative error of the reduced gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for label in ("int8 blocks, nearest", "int8 blocks, stochastic"):
        torch._dynamo.reset()
        exact_model, exact_opt, exact = _compiled(mesh, {})
        model, opt, quantized = _compiled(mesh, REDUCTIONS[label])
        per_step = []
        for step in range(steps):
            tokens = _batch(step, rank, world)
            for run in (exact, quantized):
                lm_loss(run(tokens), tokens).backward()
            in_flight.settle_all()  # a reduce-scatter left in flight (overlap_last_reduce) lands first
            rows = []
            for a, b in zip(buffers_of(exact_model), buffers_of(model)):
                ga, gb = a.gradient_buffer(), b.gradient_buffer()
                sums = torch.stack([(gb - ga).square().sum(), ga.square().sum()])
                dist.all_reduce(sums)
                rows.append((sums[0] / sums[1]).sqrt().item())
                gb.copy_(ga)  # step along the exact trajectory
            per_step.append(rows)
            exact_opt.step()
            opt.step()
            exact_opt.zero_grad(set_to_none=False)
            opt.zero_grad(set_to_none=False)
        out[label] = {"per_step": per_step, "buckets": [b.names[0] for b in buffers_of(model)],
                      "bucket_elements": [b.layout.shard_size * world for b in buffers_of(model)]}
    return out


def _bytes(rank: int, world: int) -> dict:
    """Per reduction: bytes this rank sends to others in one step's gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for label, options in REDUCTIONS.items():
        torch._dynamo.reset()
        _, opt, run = _compiled(mesh, options)
        tokens = _batch(0, rank, world)
        for profiled in (False, True):  # compile (the profiler would hold the parameters swapped), then measure
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) \
                    if profiled else contextlib.nullcontext() as prof:
                lm_loss(run(tokens), tokens).backward()
            opt.step()
            opt.zero_grad()
        sent = 0.0
        for e in prof.events():
            if e.name in ("_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_to_all_single"):
                numel = 1
                for d in e.input_shapes[0]:
                    numel *= d
                sent += numel * _ELEMENT_SIZES[e.input_dtypes[0]] * (world - 1) / world
        out[label] = sent
    return out


KINDS = {"exact": None, "int8 nearest": "nearest", "int8 stochastic": "stochastic"}  # convergence: label -> rounding
_COLORS = {"exact": "C0", "int8 nearest": "C3", "int8 stochastic": "C2"}


def _train(seed: int, kind: str, args, log_dir: Path) -> dict:
    rounding = KINDS[kind]
    log = log_dir / f"{rounding or 'exact'}_seed{seed}.json"
    if args.reuse and log.exists():
        return json.loads(log.read_text())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train.py"), "--dim", "64", "--layers", "2", "--heads", "4", "--seq-len", "64",
           "--global-batch", "8", "--steps", str(args.steps), "--seed", str(seed), "--compiler", "aot_eager",
           "--eval-every", "0", "--sample-bytes", "0", "--no-progress", "--log-json", str(log),
           *(["--quantized-reduce", rounding] if rounding else [])]
    subprocess.run(cmd, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL, cwd=ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads(log.read_text())


def _plot(runs: dict, seeds: int, path: Path) -> None:
    """Top: every run's loss curve. Bottom: per seed, int8 - exact (each rounding), beside exact seed k - exact
    seed 0 (the run-to-run spread the difference is to be compared with)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    for (kind, seed), result in sorted(runs.items()):
        top.plot(range(1, len(result["losses"]) + 1), result["losses"], lw=0.8, ls="-" if kind == "exact" else ":",
                 color=_COLORS[kind], label=kind if seed == 0 else None)
    top.set(ylabel="training loss", title="exact fp32 vs int8-block gradient reduce-scatter (2 ranks)")
    top.legend()
    base = runs["exact", 0]["losses"]
    for seed in range(seeds):
        exact = runs["exact", seed]["losses"]
        steps = range(1, len(exact) + 1)
        for kind in list(KINDS)[1:]:
            bottom.plot(steps, [b - a for a, b in zip(exact, runs[kind, seed]["losses"])], lw=0.8, color=_COLORS[kind],
                        label=f"{kind} - exact, same seed" if seed == 0 else None)
        if seed:
            bottom.plot(steps, [b - a for a, b in zip(base, exact)], lw=0.6, color="0.6",
                        label="exact seed k - exact seed 0" if seed == 1 else None)
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set(xlabel="step", ylabel="loss difference")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("error", "bytes", "convergence"), default=None)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--error-steps", type=int, default=20)
    p.add_argument("--steps", type=int, default=300, help="convergence: training steps")
    p.add_argument("--seeds", type=int, default=3, help="convergence: seeds per setting")
    p.add_argument("--reuse", action="store_true", help="convergence: reuse run logs that exist")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=HERE / "results" / "quantized_reduce.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "quantized_reduce_convergence.png")
    return p


def main() -> None:
    args = build_parser().parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.only in (None, "error"):
        errors = run_distributed(_errors, args.world_size, args.error_steps, timeout=3600)[0]
        results["error"] = errors
        print(f"relative error of the reduced gradient per bucket, {args.world_size} ranks, {args.error_steps} steps")
        print(f"{'rounding':>24} | {'median':>8} | {'p90':>8} | {'max':>8} | {'first step':>10} | {'last step':>9}")
        for label, r in errors.items():
            flat = sorted(e for row in r["per_step"] for e in row)
            q = lambda f: flat[min(len(flat) - 1, int(f * len(flat)))]  # noqa: E731
            print(f"{label:>24} | {q(0.5):8.4f} | {q(0.9):8.4f} | {flat[-1]:8.4f} | "
                  f"{statistics.median(r['per_step'][0]):10.4f} | {statistics.median(r['per_step'][-1]):9.4f}")
    if args.only in (None, "bytes"):
        sent = run_distributed(_bytes, args.world_size, timeout=3600)[0]
        results["bytes_sent_per_rank"] = sent
        print(f"bytes each rank sends in one step's gradient reduction, {args.world_size} ranks")
        for label, b in sent.items():
            print(f"{label:>24} | {b / 2**20:8.3f} MiB | {b / sent['fp32']:.3f}x fp32")
    if args.only in (None, "convergence"):
        log_dir = HERE / "results" / "quantized_reduce"
        log_dir.mkdir(parents=True, exist_ok=True)
        runs = {(kind, seed): _train(seed, kind, args, log_dir) for seed in range(args.seeds) for kind in KINDS}
        final = {kind: [statistics.mean(runs[kind, s]["losses"][-10:]) for s in range(args.seeds)] for kind in KINDS}
        results["convergence"] = {"steps": args.steps, "seeds": args.seeds, "final_loss": final,
                                  "losses": {f"{k}_seed{s}": r["losses"] for (k, s), r in runs.items()}}
        try:
            _plot(runs, args.seeds, args.plot)
        except ImportError as e:  # matplotlib is in the [bench] extra
            print(f"no plot: {e}")
        spread = max(final["exact"]) - min(final["exact"])
        print(f"final train loss (mean of last 10 of {args.steps} steps), 2 ranks, seeds 0..{args.seeds - 1}")
        for kind, values in final.items():
            print(f"{kind:>15} | " + " | ".join(f"{v:.4f}" for v in values) + f" | mean {statistics.mean(values):.4f}")
        print(f"exact seed-to-seed spread {spread:.4f}")
        for kind in list(KINDS)[1:]:
            diffs = [[b - a for a, b in zip(runs["exact", s]["losses"], runs[kind, s]["losses"])] for s in range(args.seeds)]
            print(f"{kind} - exact per seed (final): " + ", ".join(f"{b - a:+.4f}" for a, b in zip(final["exact"], final[kind]))
                  + f"; largest at any step {max(abs(d) for row in diffs for d in row):.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
