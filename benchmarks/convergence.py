"""Convergence of the structure-aware optimizers: sharded (2 gloo ranks) vs one process, same global batch.

Runs ``examples/train.py --optimizer X`` for every optimizer twice -- under
``python -m torch.distributed.run --standalone --nproc-per-node 2`` and as one plain process -- with the
same seed and global batch (each rank trains on its half), collects every step's loss from
``--log-json``, and plots the two curves per optimizer (``docs/img/convergence.png``, with the absolute
difference per step underneath) and writes ``benchmarks/results/convergence.json``.

A third, *control* run per optimizer trains one process with 2 intra-op threads: no sharding, only other
summation orders inside the kernels. Its distance from the 1-thread run shows how far fp32 rounding
differences alone carry each optimizer in this many steps (sharding changes the gradient sum's order too).

    python benchmarks/convergence.py                          # 200 steps of the default model, aot_eager
    python benchmarks/convergence.py --steps 30 --small       # a quick look
    python benchmarks/convergence.py --reuse                  # re-plot from the saved run logs

Runs one after another (each 2-rank run uses both cores of a 2-core machine). The default model with
aot_eager takes about 0.3-0.5 s per step on a loaded 2-core machine: 12 runs of 200 steps ~ 20 min.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train.py"
RESULTS = ROOT / "benchmarks" / "results"
OPTIMIZERS = ("muon", "shampoo", "adamw8bit", "adamw")
SMALL_MODEL = ["--dim", "64", "--layers", "2", "--heads", "4", "--seq-len", "64", "--global-batch", "8"]


def run_one(optimizer: str, world: int, args, log_dir: Path, threads: int = 1) -> dict:
    """One training run; returns its ``--log-json`` content (the RESULT json plus per-step losses)."""
    log = log_dir / (f"{optimizer}_{world}rank" + (f"_{threads}threads" if threads != 1 else "") + ".json")
    if args.reuse and log.exists():
        return json.loads(log.read_text())
    train_args = [str(EXAMPLE), "--optimizer", optimizer, "--steps", str(args.steps), "--compiler", args.compiler,
                  "--eval-every", "0", "--no-progress", "--threads", str(threads), "--log-json", str(log),
                  *(SMALL_MODEL if args.small else [])]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *train_args]
    else:
        cmd = [sys.executable, *train_args]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    gathered = [line for line in proc.stderr.splitlines() if "gathers" in line and "Warning" in line]
    if gathered:  # the optimizer was built before sharding: its blocks must never be cut
        raise SystemExit(f"{optimizer} on {world} ranks gathered to a root:\n" + "\n".join(gathered))
    print(f"  {optimizer:<9} {world} rank(s), {threads} thread(s): {time.monotonic() - start:5.0f} s", flush=True)
    return json.loads(log.read_text())


def summarize(runs: dict[str, dict], world: int) -> dict:
    summary = {}
    for opt, by_world in runs.items():
        sharded, single = by_world[world], by_world[1]
        diffs = [abs(a - b) for a, b in zip(sharded["losses"], single["losses"])]
        control = by_world.get("control")
        summary[opt] = {
            "control_max_abs_loss_diff": None if control is None else
            max(abs(a - b) for a, b in zip(control["losses"], single["losses"])),
            "control_diffs": None if control is None else
            [abs(a - b) for a, b in zip(control["losses"], single["losses"])],
            "max_abs_loss_diff": max(diffs),
            "max_abs_loss_diff_step": diffs.index(max(diffs)),
            "max_abs_loss_diff_first_20": max(diffs[:20]),
            "final_train_loss": {"sharded": sharded["final_train_loss"], "single": single["final_train_loss"]},
            "eval_loss": {"sharded": sharded["eval_loss"], "single": single["eval_loss"]},
            "first_loss": sharded["first_loss"],
            "step_time_median_s": {"sharded": sharded["step_time_median_s"], "single": single["step_time_median_s"]},
            "diffs": diffs,
        }
    return summary


def plot(runs: dict[str, dict], summary: dict, world: int, out: Path, title: str, control_threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts = list(runs)
    fig, axes = plt.subplots(2, len(opts), figsize=(3.6 * len(opts), 5.6), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1.4]}, squeeze=False)
    for col, opt in enumerate(opts):
        top, bottom = axes[0][col], axes[1][col]
        steps = range(1, len(runs[opt][1]["losses"]) + 1)
        top.plot(steps, runs[opt][1]["losses"], color="tab:blue", lw=2.2, alpha=0.55, label="1 process")
        top.plot(steps, runs[opt][world]["losses"], color="tab:red", lw=0.9, ls="--", label=f"{world} ranks (sharded)")
        top.set_title(f"{opt}: max |Δ| = {summary[opt]['max_abs_loss_diff']:.1e}", fontsize=10)
        top.grid(alpha=0.3)
        diffs = [max(d, 1e-9) for d in summary[opt]["diffs"]]
        if summary[opt]["control_diffs"] is not None:
            control = [max(d, 1e-9) for d in summary[opt]["control_diffs"]]
            bottom.semilogy(steps, control, color="tab:orange", lw=0.8, alpha=0.8,
                            label=f"control: 1 proc, {control_threads} threads")
            diffs_max = max(max(diffs), max(control))
        else:
            diffs_max = max(diffs)
        bottom.semilogy(steps, diffs, color="0.25", lw=0.8, label="sharded")
        bottom.set_ylim(1e-9, max(1e-3, diffs_max * 3))
        bottom.grid(alpha=0.3)
        bottom.set_xlabel("step")
        if col == 0:
            top.set_ylabel("train loss (nats/byte)")
            bottom.set_ylabel("|Δloss| vs 1 process\n(0 drawn at 1e-9)", fontsize=8)
            top.legend(fontsize=8)
            bottom.legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS + ("sgd",))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--world", type=int, default=2, help="ranks of the sharded run")
    p.add_argument("--compiler", choices=("aot_eager", "inductor"), default="aot_eager")
    p.add_argument("--small", action="store_true", help="the test's small model (dim 64, 2 layers) instead of the default")
    p.add_argument("--control-threads", type=int, default=2,
                   help="also run one process with this many threads: a control for how much rounding differences "
                   "alone (other kernels' summation order, no sharding) move the curve (0: no control run)")
    p.add_argument("--reuse", action="store_true", help="reuse run logs that exist instead of training again")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--log-dir", type=Path, default=RESULTS / "convergence")
    p.add_argument("--out", type=Path, default=RESULTS / "convergence.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "convergence.png")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)

    runs: dict[str, dict] = {}
    for opt in args.optimizers:
        runs[opt] = {w: run_one(opt, w, args, args.log_dir) for w in (args.world, 1)}
        if args.control_threads > 1:
            runs[opt]["control"] = run_one(opt, 1, args, args.log_dir, threads=args.control_threads)
    summary = summarize(runs, args.world)
    model = "small model (dim 64, 2 layers)" if args.small else "default model (dim 128, 4 layers, 0.8 M params)"
    settings = {"steps": args.steps, "world": args.world, "compiler": args.compiler, "model": model,
                "control_threads": args.control_threads,
                "train_args": {k: v for k, v in runs[args.optimizers[0]][1]["args"].items() if k != "log_json"}}
    args.out.write_text(json.dumps({"settings": settings, "optimizers": summary}, indent=1))
    print(f"wrote {args.out}")

    print(f"\n{args.steps} steps, {model}, {args.compiler}, {args.world} ranks vs 1 process, same global batch")
    header = (f"{'optimizer':<10} {'max |Δloss|':>12} {'at step':>8} {'control':>9} {'final train (shard/1p)':>24} "
              f"{'eval (shard/1p)':>18}")
    print(header + "\n" + "-" * len(header))
    for opt, s in summary.items():
        control = "-" if s["control_max_abs_loss_diff"] is None else f"{s['control_max_abs_loss_diff']:.2e}"
        print(f"{opt:<10} {s['max_abs_loss_diff']:>12.2e} {s['max_abs_loss_diff_step'] + 1:>8} {control:>9} "
              f"{s['final_train_loss']['sharded']:>11.4f}/{s['final_train_loss']['single']:<12.4f} "
              f"{s['eval_loss']['sharded']:>8.4f}/{s['eval_loss']['single']:<9.4f}")
    plot(runs, summary, args.world, args.plot,
         f"examples/train.py, {model}, {args.steps} steps, {args.compiler}: {args.world} gloo ranks vs 1 process",
         args.control_threads)


if __name__ == "__main__":
    main()
