"""FP8 all-gather vs full-precision gathers: the same training run (2 gloo ranks) with and without ``--fp8``.

Runs ``examples/train.py`` twice under ``python -m torch.distributed.run --standalone --nproc-per-node 2``
with the same seed, model and global batch, once gathering the layer weights as FP8 codes and
128x128 scales (``--fp8``) and once in the parameters' own dtype, collects every step's loss from
``--log-json``, plots both curves with their difference underneath (``docs/img/fp8_convergence.png``)
and writes ``benchmarks/results/fp8_convergence.json``.

    python benchmarks/fp8_convergence.py                 # 200 steps, dim 128, ffn 256 (multiples of 128)
    python benchmarks/fp8_convergence.py --steps 30      # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train.py"
RESULTS = ROOT / "benchmarks" / "results"
MODEL = ["--dim", "128", "--ffn", "256", "--layers", "4", "--heads", "4", "--seq-len", "128"]


def run(fp8: bool, args, log_dir: Path) -> dict:
    """One 2-rank training run; returns its ``--log-json`` content (RESULT plus per-step losses)."""
    log = log_dir / ("fp8.json" if fp8 else "full_precision.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
           *MODEL, "--steps", str(args.steps), "--compiler", args.compiler, "--eval-every", "0",
           "--sample-bytes", "0", "--no-progress", "--log-json", str(log), *(["--fp8"] if fp8 else [])]
    subprocess.run(cmd, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
    return json.loads(log.read_text())


def plot(full: list[float], fp8: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 1))
    steps = range(1, len(full) + 1)
    top.plot(steps, full, label="gathers in the parameter dtype (fp32)", lw=1)
    top.plot(steps, fp8, label="FP8 all-gather (e4m3 codes + 128x128 scales)", lw=1)
    top.set_ylabel("training loss")
    top.legend()
    bottom.plot(steps, [b - a for a, b in zip(full, fp8)], lw=1, color="C3")
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_ylabel("FP8 - full")
    bottom.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compiler", choices=("aot_eager", "inductor"), default="aot_eager")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=RESULTS / "fp8_convergence.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "fp8_convergence.png")
    return p


def main() -> None:
    args = build_parser().parse_args()
    log_dir = RESULTS / "fp8_convergence"
    log_dir.mkdir(parents=True, exist_ok=True)
    full, fp8 = run(False, args, log_dir), run(True, args, log_dir)
    last = lambda r: statistics.mean(r["losses"][-10:])  # noqa: E731
    summary = {
        "steps": args.steps, "model": MODEL, "compiler": args.compiler,
        "final_loss_full_precision": last(full), "final_loss_fp8": last(fp8),
        "final_loss_difference": last(fp8) - last(full),
        "max_abs_step_difference": max(abs(a - b) for a, b in zip(full["losses"], fp8["losses"])),
        "losses_full_precision": full["losses"], "losses_fp8": fp8["losses"],
    }
    args.out.write_text(json.dumps(summary, indent=1))
    plot(full["losses"], fp8["losses"], args.plot)
    print("| gathers | final train loss (mean of last 10) |\n|---|---|")
    print(f"| parameter dtype (fp32) | {summary['final_loss_full_precision']:.4f} |")
    print(f"| FP8 | {summary['final_loss_fp8']:.4f} |")
    print(f"difference {summary['final_loss_difference']:+.4f}; largest per-step difference "
          f"{summary['max_abs_step_difference']:.4f}; wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
