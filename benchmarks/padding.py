"""Padding overhead of the structure-aware planner vs. baselines (the paper's Figure 11, and more).

For Llama-3-70B, GPT-OSS-120B and DeepSeek-V3 (shapes in ``model_shapes.py``), FSDP sizes 8…16384
and block granularities of 1x, 16x and 128x the row size, this measures

    padding overhead = padding elements / parameter elements

for (a) one transformer layer (the most common layer shape: the MoE layer for DeepSeek-V3) and
(b) the whole model (the sum over units: embedding, every layer, head), with align = 8 elements, for

* ``plan``          — one bucket per unit, planned by ``fsdp_pass.planner.plan``;
* ``plan_buckets``  — each unit split into buckets by ``fsdp_pass.planner.plan_buckets``;
* ``naive_concat``  — concatenate, split evenly (no padding to speak of, but blocks are cut);
* ``fsdp2_shard0``  — FSDP2's per-parameter Shard(0) with dim 0 padded to a multiple of m;
* ``rowwise_concat`` — Megatron-FSDP style: in order, rank boundaries on dim-0 slices only.

The baselines also report ``blocks_cut``: rank boundaries that fall inside a block (the planner's
layouts never cut one: every layout is validated).

**Block granularity.** A tensor's *row* is its last dimension (``shape[-1]`` elements) and it has
``numel / row`` rows (leading dimensions flattened, so a fused (128, 2880, 5760) expert tensor has
368640 rows of 5760). At ``k``x the block is ``k'`` rows, where ``k'`` is the largest divisor of the
row count that is at most ``k`` (a block must divide the tensor): 2880 rows at 128x gives 120-row
blocks. A 1-D tensor (norm, bias) is a single row, so its block is the whole tensor at every ``k``.

Whole-model figures plan each *distinct* unit (same list of shapes) once and multiply by how many
times it occurs; layers repeat, so this is exact and much faster than planning every layer.

Run: ``python benchmarks/padding.py [--models a,b] [--world-sizes 8,1024] [--quick]``. Writes
``benchmarks/results/padding.json`` and, with matplotlib (the ``bench`` extra), ``padding.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import fsdp_pass.planner  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:
    sys.path.insert(0, str(HERE.parent))

from model_shapes import MODELS, QUOTED_PARAMS, distinct_units, representative_layer, total_params, unit_numel  # noqa: E402

from baselines import fsdp2_shard0, naive_concat, rowwise_concat  # noqa: E402
from fsdp_pass.planner import TensorSpec, plan, plan_buckets  # noqa: E402

ALIGN = 8
GRANULARITIES = (1, 16, 128)
WORLD_SIZES = tuple(2**k for k in range(3, 15))  # 8 ... 16384
QUICK_WORLD_SIZES = (8, 64, 512, 1024)
METHODS = ("plan", "plan_buckets", "naive_concat", "fsdp2_shard0", "rowwise_concat")
TIMING_WORLD_SIZE = 1024
TIMING_REPEATS = 3

# Padding targets: (granularity, largest FSDP size, max padding fraction) with plan_buckets.
TARGETS = ((1, 1024, 0.01), (16, 1024, 0.01), (128, 512, 0.05))
TARGET_PLANNING_MS = 50.0


def block_of(shape: tuple[int, ...], k: int) -> int:
    """``k'`` rows of ``shape[-1]`` elements, ``k'`` the largest divisor of the row count <= ``k``."""
    row = shape[-1] if shape else 1
    rows = math.prod(shape) // row if row else 0
    if rows == 0:
        return 1
    kk = max(d for d in range(1, min(k, rows) + 1) if rows % d == 0)
    return kk * row


def specs_of(params, k: int) -> list[TensorSpec]:
    return [TensorSpec(name, math.prod(shape), block_of(shape, k), tuple(shape)) for name, shape in params]


def measure_unit(specs: list[TensorSpec], m: int) -> dict[str, dict[str, int]]:
    """Padding (and blocks cut, for baselines) of one unit under every method."""
    whole = plan(specs, m, ALIGN)
    whole.validate()
    buckets = plan_buckets(specs, m, ALIGN)
    for b in buckets:
        b.validate()
    out = {
        "plan": {"padding": whole.padding, "blocks_cut": 0, "buckets": 1},
        "plan_buckets": {"padding": sum(b.padding for b in buckets), "blocks_cut": 0, "buckets": len(buckets)},
    }
    for name, base in (
        ("naive_concat", naive_concat(specs, m, ALIGN)),
        ("fsdp2_shard0", fsdp2_shard0(specs, m)),
        ("rowwise_concat", rowwise_concat(specs, m, ALIGN)),
    ):
        out[name] = {"padding": base.padding, "blocks_cut": base.blocks_cut, "buckets": 1}
    return out


def time_ms(fn, repeats: int = TIMING_REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def run(models: list[str], world_sizes: list[int], granularities=GRANULARITIES) -> dict:
    results: dict = {"align": ALIGN, "world_sizes": world_sizes, "granularities": list(granularities), "models": {}}
    for model in models:
        units = distinct_units(model)
        layer_name, layer_params = representative_layer(model)
        total = total_params(model)
        layer_numel = unit_numel(layer_params)
        entry = {
            "params": total,
            "quoted_params": QUOTED_PARAMS[model],
            "layer": layer_name,
            "layer_params": layer_numel,
            "distinct_units": [(name, count, unit_numel(p), len(p)) for name, p, count in units],
            "padding": {},  # [granularity][scope][method][m] -> fraction
            "blocks_cut": {},  # [granularity][scope][method][m] -> count (baselines)
            "buckets": {},  # [granularity][m] -> plan_buckets bucket count for the layer
            "planning_ms": {},  # [granularity] -> {"plan": ms, "plan_buckets": ms} at m = TIMING_WORLD_SIZE
        }
        t0 = time.perf_counter()
        for k in granularities:
            unit_specs = [(name, specs_of(p, k), count) for name, p, count in units]
            pad = {scope: {meth: {} for meth in METHODS} for scope in ("layer", "model")}
            cut = {scope: {meth: {} for meth in METHODS} for scope in ("layer", "model")}
            nbuckets = {}
            for m in world_sizes:
                model_pad = dict.fromkeys(METHODS, 0)
                model_cut = dict.fromkeys(METHODS, 0)
                for name, specs, count in unit_specs:
                    res = measure_unit(specs, m)
                    for meth in METHODS:
                        model_pad[meth] += count * res[meth]["padding"]
                        model_cut[meth] += count * res[meth]["blocks_cut"]
                        if name == layer_name:
                            pad["layer"][meth][m] = res[meth]["padding"] / layer_numel
                            cut["layer"][meth][m] = res[meth]["blocks_cut"]
                    if name == layer_name:
                        nbuckets[m] = res["plan_buckets"]["buckets"]
                for meth in METHODS:
                    pad["model"][meth][m] = model_pad[meth] / total
                    cut["model"][meth][m] = model_cut[meth]
            entry["padding"][k], entry["blocks_cut"][k], entry["buckets"][k] = pad, cut, nbuckets
            layer_specs = specs_of(layer_params, k)
            entry["planning_ms"][k] = {
                "plan": time_ms(lambda: plan(layer_specs, TIMING_WORLD_SIZE, ALIGN)),
                "plan_buckets": time_ms(lambda: plan_buckets(layer_specs, TIMING_WORLD_SIZE, ALIGN)),
            }
        entry["seconds"] = time.perf_counter() - t0
        results["models"][model] = entry
        print(f"# {model}: measured in {entry['seconds']:.1f} s", file=sys.stderr, flush=True)
    return results


def check_targets(results: dict) -> list[dict]:
    """PASS/MISS per (model, granularity, scope) for the padding targets."""
    out = []
    for model, entry in results["models"].items():
        for k, max_m, limit in TARGETS:
            if k not in entry["padding"]:
                continue
            for scope in ("model", "layer"):
                series = entry["padding"][k][scope]["plan_buckets"]
                ms = [m for m in series if m <= max_m]
                if not ms:
                    continue
                worst_m = max(ms, key=lambda m: series[m])
                out.append({
                    "model": model, "granularity": k, "scope": scope, "max_world_size": max_m,
                    "target": limit, "worst": series[worst_m], "at": worst_m,
                    "pass": series[worst_m] <= limit,
                })
        ms = max(max(v.values()) for v in entry["planning_ms"].values())
        out.append({
            "model": model, "granularity": "all", "scope": f"planning ms/layer at m={TIMING_WORLD_SIZE}",
            "max_world_size": TIMING_WORLD_SIZE, "target": TARGET_PLANNING_MS, "worst": ms, "at": TIMING_WORLD_SIZE,
            "pass": ms <= TARGET_PLANNING_MS,
        })
    return out


def fmt_pct(x: float) -> str:
    p = 100 * x
    if p == 0:
        return "0"
    if p < 0.01:
        return "<0.01"
    if p >= 1000:
        return f"{p:.0f}"
    return f"{p:.2f}" if p < 10 else f"{p:.1f}"


def print_tables(results: dict) -> None:
    ws = results["world_sizes"]
    for model, entry in results["models"].items():
        print(f"\n## {model}: {entry['params'] / 1e9:.2f}B parameters (quoted ~{entry['quoted_params'] / 1e9:.1f}B); "
              f"layer = {entry['layer']} ({entry['layer_params'] / 1e6:,.1f}M)")
        print("distinct units (planned once each, multiplied by count): " + ", ".join(
            f"{n} x{c} ({e / 1e6:,.1f}M, {t} tensors)" for n, c, e, t in entry["distinct_units"]))
        for k in results["granularities"]:
            print(f"\n### {model}, {k}x row blocks: padding % (blocks cut, whole model)")
            print("| scope | method | " + " | ".join(str(m) for m in ws) + " |")
            print("|---|---|" + "---|" * len(ws))
            for scope in ("layer", "model"):
                for meth in METHODS:
                    pads = entry["padding"][k][scope][meth]
                    cells = [fmt_pct(pads[m]) for m in ws]
                    if meth in ("naive_concat", "fsdp2_shard0", "rowwise_concat") and scope == "model":
                        cuts = entry["blocks_cut"][k][scope][meth]
                        cells = [f"{c} ({cuts[m]})" if cuts[m] else c for c, m in zip(cells, ws)]
                    print(f"| {scope} | {meth} | " + " | ".join(cells) + " |")
            print("| layer | buckets | " + " | ".join(str(entry["buckets"][k][m]) for m in ws) + " |")
        print(f"\nplanning time per layer at m={TIMING_WORLD_SIZE} (median of {TIMING_REPEATS}): " + "; ".join(
            f"{k}x plan {v['plan']:.1f} ms, plan_buckets {v['plan_buckets']:.1f} ms"
            for k, v in entry["planning_ms"].items()))


def print_targets(targets: list[dict]) -> None:
    print("\n## Targets (plan_buckets)")
    print("| model | granularity | scope | target | worst measured | at m | result |")
    print("|---|---|---|---|---|---|---|")
    for t in targets:
        if t["granularity"] == "all":
            print(f"| {t['model']} | all | {t['scope']} | <= {t['target']:.0f} ms | {t['worst']:.1f} ms | "
                  f"{t['at']} | {'PASS' if t['pass'] else 'MISS'} |")
        else:
            print(f"| {t['model']} | {t['granularity']}x | {t['scope']}, m <= {t['max_world_size']} | "
                  f"<= {100 * t['target']:.0f}% | {fmt_pct(t['worst'])}% | {t['at']} | {'PASS' if t['pass'] else 'MISS'} |")


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot", file=sys.stderr)
        return False
    models, ks, ws = list(results["models"]), results["granularities"], results["world_sizes"]
    fig, axes = plt.subplots(len(models), len(ks), figsize=(4.2 * len(ks), 3.2 * len(models)), squeeze=False)
    styles = {"plan": ("C0", "-"), "plan_buckets": ("C3", "-"), "naive_concat": ("C7", ":"),
              "fsdp2_shard0": ("C1", "--"), "rowwise_concat": ("C2", "-.")}
    floor = 1e-3  # percent; zero padding is drawn on the floor of the log axis
    for i, model in enumerate(models):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            for meth in METHODS:
                color, ls = styles[meth]
                ys = [max(100 * results["models"][model]["padding"][k]["model"][meth][m], floor) for m in ws]
                ax.plot(ws, ys, ls, color=color, marker=".", label=f"{meth} (model)")
            ys = [max(100 * results["models"][model]["padding"][k]["layer"]["plan_buckets"][m], floor) for m in ws]
            ax.plot(ws, ys, ":", color="C3", marker="x", label="plan_buckets (one layer)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.axhline(1, color="k", lw=0.5)
            ax.set_title(f"{model}, {k}x row", fontsize=9)
            ax.tick_params(labelsize=7)
            if j == 0:
                ax.set_ylabel("padding % of parameters", fontsize=8)
            if i == len(models) - 1:
                ax.set_xlabel("FSDP size (ranks)", fontsize=8)
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    ap.add_argument("--world-sizes", default=None, help="comma-separated FSDP sizes (default 8,16,...,16384)")
    ap.add_argument("--quick", action="store_true", help=f"only FSDP sizes {','.join(map(str, QUICK_WORLD_SIZES))}")
    ap.add_argument("--out-dir", default=str(HERE / "results"), help="where padding.json / padding.png go")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    if args.world_sizes:
        world_sizes = sorted({int(x) for x in args.world_sizes.split(",")})
    else:
        world_sizes = list(QUICK_WORLD_SIZES if args.quick else WORLD_SIZES)
    start = time.perf_counter()
    print(f"# padding benchmark: models {models}, FSDP sizes {world_sizes}, granularities "
          f"{list(GRANULARITIES)} x row, align {ALIGN}; whole-model figures plan each distinct unit once "
          f"and multiply by its count (layers repeat)")
    results = run(models, world_sizes)
    results["seconds"] = time.perf_counter() - start
    print_tables(results)
    targets = check_targets(results)
    results["targets"] = targets
    print_targets(targets)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "padding.json").write_text(json.dumps(results, indent=1, default=str))
    plotted = plot(results, out / "padding.png")
    print(f"\nwrote {out / 'padding.json'}" + (f" and {out / 'padding.png'}" if plotted else "")
          + f"; total {results['seconds']:.1f} s on {os.cpu_count()} CPUs (single-threaded)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
