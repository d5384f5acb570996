"""The bucket cost model's constants, measured: time of one collective = latency + bytes / bandwidth.

Runs ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` at sizes from 8 KiB to 16 MiB on
``--world-size`` gloo ranks (each pinned to its own core, one thread, as in ``step_time.py``), times
``--iters`` calls of each after warm-up (a barrier before each call, so a call's time is its own, not
a late peer's), and fits ``latency + bytes / bandwidth`` to the medians by least squares. ``bytes`` is
the gathered (whole-bucket) size, the quantity ``min_bucket_bytes`` compares. Prints a table, the fit
and the ``min_bucket_bytes`` the fit gives (``fsdp_pass.sharding.buckets.min_bucket_bytes_for``);
writes ``benchmarks/results/collective_cost.json``.

Run: ``python benchmarks/collective_cost.py [--world-size 2] [--iters 20]``. CPU (gloo) only: NCCL
needs a GPU machine (``gpu_check.py`` measures NCCL's collectives there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_pass.sharding.buckets import min_bucket_bytes_for  # noqa: E402
from fsdp_pass.testing.spawn import run_distributed  # noqa: E402

SIZES_KIB = (8, 64, 256, 1024, 2048, 4096, 8192, 16384)


def _measure(rank: int, world: int, iters: int) -> dict:
    torch.set_num_threads(1)
    rows = {}
    for kib in SIZES_KIB:
        numel = kib * 1024 // 4 // world * world  # float32, divisible by the world size
        whole = torch.ones(numel)
        piece = torch.ones(numel // world)
        times = {"all_gather": [], "reduce_scatter": []}
        for i in range(iters + 3):  # the first 3: warm-up
            for kind in times:
                dist.barrier()
                start = time.perf_counter()
                if kind == "all_gather":
                    dist.all_gather_into_tensor(whole, piece)
                else:
                    dist.reduce_scatter_tensor(piece, whole)
                if i >= 3:
                    times[kind].append(time.perf_counter() - start)
        rows[numel * 4] = {kind: statistics.median(t) for kind, t in times.items()}
    return rows


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = latency + bytes / bandwidth`` → (latency s, bandwidth bytes/s)."""
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
    return mean_t - slope * mean_b, 1 / slope


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=str(HERE / "results" / "collective_cost.json"))
    return parser


def main() -> None:
    args = build_parser().parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_distributed(_measure, args.world_size, args.iters, pin_cores=True, timeout=900)
    slowest = {b: {k: max(r[b][k] for r in results) for k in results[0][b]} for b in results[0]}
    print(f"gloo, {args.world_size} ranks, median of {args.iters} calls (slowest rank)")
    print(f"{'bytes':>10} | {'all_gather ms':>13} | {'reduce_scatter ms':>17}")
    for b, row in slowest.items():
        print(f"{b:>10} | {row['all_gather'] * 1e3:13.2f} | {row['reduce_scatter'] * 1e3:17.2f}")
    fits = {}
    for kind in ("all_gather", "reduce_scatter"):
        latency, bandwidth = _fit([(b, row[kind]) for b, row in slowest.items()])
        fits[kind] = {"latency_s": latency, "bandwidth_bytes_per_s": bandwidth,
                      "min_bucket_bytes": min_bucket_bytes_for(latency, bandwidth)}
        print(f"{kind}: latency {latency * 1e3:.2f} ms, bandwidth {bandwidth / 1e9:.2f} GB/s "
              f"-> min_bucket_bytes {fits[kind]['min_bucket_bytes'] / 1e6:.2f} MB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"backend": "gloo", "world_size": args.world_size, "iters": args.iters,
                                          "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": slowest,
                                          "fit": fits}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
