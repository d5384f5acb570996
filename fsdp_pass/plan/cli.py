"""``python -m fsdp_pass``: plan a model's sharding offline, or show what the backend does to a small model.

``plan`` reports buckets, padding, per-rank memory and communication per step of a model sharded
at any world size (:func:`fsdp_pass.plan.report.plan_model`; ``--png`` also charts a sweep of
shard ranks). ``explain`` compiles a small built-in model with the ``"vescale"`` backend on a fake
process group, runs one forward and backward, and prints :func:`fsdp_pass.explain`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Sequence

import torch
import torch.nn as nn

from ..compile.explain import explain
from .model_configs import MODELS, TinyTransformer, load_model
from .report import DTYPES, OPTIMIZER_STATES, plan_model
from ..testing.fake_pg import fake_process_group

__all__ = ["build_parser", "main", "plot_sweep"]

BLOCK_POLICIES = {"element": 0, "row": 1, "16row": 16, "128row": 128}  # rows per block; 0: one element


def plot_sweep(model: nn.Module, name: str, largest: int, path: str, **plan_options) -> None:
    """Write a chart of padding and per-rank parameter memory for 2, 4, ... ``largest`` shard ranks."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install -e '.[bench]'") from None
    sizes = [2**k for k in range(1, largest.bit_length()) if 2**k <= largest]
    plans = [plan_model(model, (m,), name=name, **plan_options) for m in sizes]
    fig, (pad_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 4))
    pad_ax.plot(sizes, [100 * p.padding / p.params for p in plans], marker="o")
    pad_ax.set(xscale="log", xlabel="ranks sharded over (m)", ylabel="padding (% of parameters)", title="padding")
    mem_ax.plot(sizes, [p.per_rank_bytes()["params"] / 2**30 for p in plans], marker="o")
    mem_ax.set(xscale="log", yscale="log", xlabel="ranks sharded over (m)", ylabel="GiB per rank",
               title="parameter shard per rank")
    for ax in (pad_ax, mem_ax):
        ax.set_xticks(sizes, [str(m) for m in sizes], rotation=90)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{name}: {plans[0].settings()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mesh_shape(args: argparse.Namespace) -> tuple[int, ...]:
    if args.mesh_shape is None:
        if args.world_size is None:
            raise SystemExit("plan: give --world-size or --mesh-shape")
        if args.tp < 1 or args.world_size % args.tp:
            raise SystemExit(f"--tp {args.tp} must divide --world-size {args.world_size}")
        return (args.world_size // args.tp,)
    try:
        shape = tuple(int(d) for d in args.mesh_shape.lower().split("x"))
    except ValueError:
        raise SystemExit(
            f"--mesh-shape {args.mesh_shape!r}: write it as SHARD or REPLICATExSHARD, e.g. 2x8192"
        ) from None
    if len(shape) not in (1, 2) or min(shape) < 1:
        raise SystemExit(f"--mesh-shape {args.mesh_shape!r}: 1 or 2 positive sizes, e.g. 8192 or 2x8192")
    if args.world_size is not None and math.prod(shape) * args.tp != args.world_size:
        raise SystemExit(
            f"--mesh-shape {args.mesh_shape} x --tp {args.tp} covers {math.prod(shape) * args.tp} ranks, not "
            f"--world-size {args.world_size}"
        )
    return shape


def _element_count(text: str) -> int:
    """``100000000``, ``1e8`` or ``100_000_000``."""
    value = float(text.replace("_", ""))
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of elements")
    return int(value)


def _reshard_after_forward(args: argparse.Namespace) -> bool | int:
    if args.no_reshard_after_forward and args.reshard_after_forward is not None:
        raise SystemExit("plan: give --no-reshard-after-forward or --reshard-after-forward K, not both")
    if args.no_reshard_after_forward:
        return False
    return True if args.reshard_after_forward is None else args.reshard_after_forward


def _run_plan(args: argparse.Namespace) -> int:
    mesh_shape = _mesh_shape(args)
    block_rows = args.block_rows if args.block_rows is not None else BLOCK_POLICIES[args.block_policy]
    param_dtype = DTYPES[args.param_dtype]
    options = dict(bucket_size=args.bucket_size, block_rows=block_rows, param_dtype=param_dtype,
                   reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                   optimizer=args.optimizer, reshard_after_forward=_reshard_after_forward(args),
                   node_size=args.node_size, quantized_reduce_block=128 if args.quantized_reduce == "int8" else None)
    parallel = dict(tp=args.tp, ep=args.ep, fp8=args.fp8)
    started = time.perf_counter()
    try:
        model = load_model(args.model, param_dtype)
        summary = plan_model(model, mesh_shape, name=args.model, **options, **parallel)
    except (ValueError, TypeError) as e:  # a model or option fsdp_pass cannot shard: say why, no traceback
        raise SystemExit(f"plan: {e}") from None
    # Report the whole run, model construction included.
    summary = dataclasses.replace(summary, seconds=time.perf_counter() - started)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.to_text())
    if args.png:
        plot_sweep(model, args.model, mesh_shape[-1], args.png, **options)
        if not args.json:
            print(f"wrote {args.png}")
    return 0


def _run_explain(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model = TinyTransformer()
    with fake_process_group(args.world_size):
        compiled = torch.compile(model, backend="vescale", options={"compiler": args.compiler})
        tokens = torch.randint(0, 32, (2, 8))
        compiled(tokens).float().square().mean().backward()
        explain(compiled)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m fsdp_pass`` argument parser: commands ``plan`` and ``explain``."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_pass",
        description="Plan fully sharded data parallel layouts offline, or show the backend's graphs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,explain}")

    plan = commands.add_parser(
        "plan", help="buckets, padding, per-rank memory and communication of a model at any world size",
        description="Shard a meta-device copy of a model as fsdp_pass.fully_shard does, on a fake process "
                    "group, and report buckets, padding, per-rank memory and communication per step.",
    )
    plan.add_argument("--model", required=True,
                      help=f"a built-in config ({', '.join(MODELS)}) or module:factory "
                           f"(called under torch.device('meta'))")
    plan.add_argument("--world-size", type=int,
                      help="ranks in all (default: the product of --mesh-shape and --tp)")
    plan.add_argument("--mesh-shape", help="SHARD or REPLICATExSHARD (HSDP), e.g. 2x8192")
    plan.add_argument("--tp", type=int, default=1,
                      help="tensor parallel ranks next to the mesh (column/row-parallel projections; default 1)")
    plan.add_argument("--ep", type=int, default=1,
                      help="expert parallel ranks out of the shard ranks (stacked experts; default 1)")
    plan.add_argument("--bucket-size", type=_element_count,
                      help="most elements per bucket (default: one bucket per unit)")
    blocks = plan.add_mutually_exclusive_group()
    blocks.add_argument("--block-rows", type=int, help="blocks of N rows (last dim) that no rank boundary cuts")
    blocks.add_argument("--block-policy", choices=list(BLOCK_POLICIES), default="element",
                        help="element, 1, 16 or 128 rows per block (default: element)")
    plan.add_argument("--param-dtype", choices=list(DTYPES), default="bf16", help="parameter dtype (default: bf16)")
    plan.add_argument("--reduce-dtype", choices=list(DTYPES), help="gradient reduction dtype (default: --param-dtype)")
    plan.add_argument("--optimizer", choices=list(OPTIMIZER_STATES), default="adamw",
                      help="adamw: 2 fp32 states per element; sgd: 1 (momentum); none (default: adamw)")
    plan.add_argument("--no-reshard-after-forward", action="store_true",
                      help="keep gathered parameters from forward to backward (no backward all_gather)")
    plan.add_argument("--reshard-after-forward", type=int, metavar="K",
                      help="keep 1/K of each bucket after forward; backward gathers within groups of K ranks "
                           "(K divides the shard ranks; e.g. the ranks of a node)")
    plan.add_argument("--quantized-reduce", choices=("int8",), default=None,
                      help="reduce-scatter gradients as int8 codes + one fp32 scale per 128 elements "
                           "(options['quantized_reduce'])")
    plan.add_argument("--node-size", type=int, default=8,
                      help="ranks per node, for the bytes received inside and across nodes (default 8)")
    plan.add_argument("--fp8", action="store_true",
                      help="all-gather block weights as FP8 codes + 128x128 tile scales (docs/fp8.md): "
                           "the all_gather bytes with and without")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--png", metavar="PATH",
                      help="also chart padding and per-rank parameter memory for 2, 4, ... shard ranks (matplotlib)")
    plan.set_defaults(run=_run_plan)

    explain_cmd = commands.add_parser(
        "explain", help="compile a small model with the vescale backend on a fake process group and print explain()",
        description="Trace a small built-in transformer through torch.compile(backend='vescale') on a fake process "
                    "group, run one forward and backward, and print fsdp_pass.explain(): the plan and the "
                    "rewritten, forward and backward graphs.",
    )
    explain_cmd.add_argument("--world-size", type=int, default=2, help="ranks of the fake process group (default: 2)")
    explain_cmd.add_argument("--compiler", choices=("aot_eager", "inductor"), default="aot_eager",
                             help="what compiles the graphs after the passes (default: aot_eager)")
    explain_cmd.set_defaults(run=_run_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)
