"""``python -m fsdp_pass``: plan a model's sharding offline, or show what the backend does to a small model.

``plan`` shards a meta-device copy of a model as :func:`fsdp_pass.fully_shard` does (its
bucketing, planner and DBuffers, without initializing values) on a single-process fake process
group of any world size (no data, no collectives) and reports buckets, padding, per-rank memory
and communication per step. ``explain`` compiles a small built-in model with the ``"vescale"``
backend on a fake process group, runs one forward and backward, and prints :func:`fsdp_pass.explain`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .explain import explain
from .model_configs import MODELS, TinyTransformer, load_model
from .runtime.dbuffer import DBuffer
from .sharding.buckets import ShardingConfig, unit_key
from .sharding.materialize import shard_parameters
from .sharding.mesh_roles import resolve_mesh
from .testing.fake_pg import fake_process_group

__all__ = ["BucketStats", "PlanSummary", "block_elements", "main", "plan_model"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK_POLICIES = {"element": 0, "row": 1, "16row": 16, "128row": 128}  # rows per block; 0: one element
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # fp32 states per parameter element
OPTIMIZER_STATE_BYTES = 4
PREFETCHED_BUCKETS = 2  # the bucket in use plus the next one, gathered ahead


def block_elements(shape: Sequence[int], rows: int) -> int:
    """A block of ``k`` rows of ``shape``, ``k`` the largest divisor of the row count that is ``<= rows``.

    A row is the last dimension (leading dims flattened, as in ``docs/padding.md``): for a matrix this
    is ``set_block(rows=k)``; a 1-D tensor is one row, so it is never cut. ``rows=0``: one element.
    """
    if rows == 0 or not shape:
        return 1
    row = shape[-1]
    count = math.prod(shape) // row if row else 0
    if count == 0:
        return 1
    return max(d for d in range(1, min(rows, count) + 1) if count % d == 0) * row


@dataclasses.dataclass(frozen=True)
class BucketStats:
    """One planned bucket, and how many identical copies of it the model has (one per repeated layer)."""

    units: tuple[str, ...]  # the module units (``layers.3``) whose copy of this bucket it stands for
    tensors: int
    numel: int
    shard_size: int  # S: elements per rank
    world_size: int  # m: ranks the bucket is sharded over
    itemsize: int
    trainable: bool
    split: int = 1  # tensor/expert parallel ranks that each hold a different part of these tensors

    @property
    def copies(self) -> int:
        return len(self.units)

    @property
    def global_size(self) -> int:
        return self.shard_size * self.world_size

    @property
    def padding(self) -> int:
        return self.global_size - self.numel

    @property
    def label(self) -> str:
        first, last = self.units[0], self.units[-1]
        return first if first == last else f"{first}..{last} (x{self.copies})"


@dataclasses.dataclass(frozen=True)
class PlanSummary:
    """How ``fully_shard`` shards a model on a mesh, and what it costs each rank per step.

    Assumptions: parameter and gradient shards keep the model's dtype (the CLI builds the model in
    ``--param-dtype``), gathers and their traffic use ``param_dtype``; optimizer states are fp32 and
    cover each rank's real elements (padding excluded, as torch.optim allocates them per local
    piece); the busiest rank is reported. Peak gathered memory is the largest bucket, twice
    (one in use and one prefetched). Communication is ring cost: per collective each rank sends
    ``(m-1)/m`` of the gathered (or reduced) bytes and receives as much; an HSDP all-reduce over
    ``r`` replicas sends ``2(r-1)/r`` of the gradient shard.
    """

    model: str
    mesh_shape: tuple[int, ...]
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer: str
    block_rows: int
    bucket_size: int | None
    reshard_after_forward: bool
    buckets: tuple[BucketStats, ...]
    least_padding_on_a_rank: int  # fewest padding elements one rank holds in trainable buckets
    seconds: float
    tp: int = 1  # tensor parallel ranks, next to mesh_shape
    ep: int = 1  # expert parallel ranks, part of the shard ranks

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape) * self.tp

    @property
    def shard_size(self) -> int:
        return self.mesh_shape[-1]

    @property
    def replicate_size(self) -> int:
        return self.mesh_shape[0] if len(self.mesh_shape) == 2 else 1

    @property
    def params(self) -> int:
        return sum(b.copies * b.numel * b.split for b in self.buckets)

    @property
    def padding(self) -> int:
        return sum(b.copies * b.padding * b.split for b in self.buckets)

    def per_rank_bytes(self) -> dict[str, int]:
        """Memory of the busiest rank, activations excluded."""
        trainable = [b for b in self.buckets if b.trainable]
        params = sum(b.copies * b.shard_size * b.itemsize for b in self.buckets)
        grads = sum(b.copies * b.shard_size * b.itemsize for b in trainable)
        real_elements = sum(b.copies * b.shard_size for b in trainable) - self.least_padding_on_a_rank
        optimizer = OPTIMIZER_STATES[self.optimizer] * OPTIMIZER_STATE_BYTES * real_elements
        largest = max((b.global_size for b in self.buckets), default=0)
        gathered = PREFETCHED_BUCKETS * largest * self.param_dtype.itemsize
        return {"params": params, "grads": grads, "optimizer": optimizer, "gathered_peak": gathered,
                "total": params + grads + optimizer + gathered}

    def comm_bytes_per_rank(self) -> dict[str, int]:
        """Bytes each rank sends per training step (it receives as many)."""
        r = self.replicate_size
        gather = sum(b.copies * (b.world_size - 1) * b.shard_size for b in self.buckets) * self.param_dtype.itemsize
        trainable = [b for b in self.buckets if b.trainable]
        grad_shards = sum(b.copies * b.shard_size for b in trainable) * self.reduce_dtype.itemsize
        scatter = sum(b.copies * (b.world_size - 1) * b.shard_size for b in trainable) * self.reduce_dtype.itemsize
        out = {
            "all_gather_forward": gather,
            "all_gather_backward": gather if self.reshard_after_forward else 0,
            "reduce_scatter": scatter,
            "all_reduce_replicas": 2 * (r - 1) * grad_shards // r,
        }
        out["total"] = sum(out.values())
        return out

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "world_size": self.world_size,
            "mesh_shape": list(self.mesh_shape),
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "tp": self.tp,
            "ep": self.ep,
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(self.reduce_dtype).removeprefix("torch."),
            "optimizer": self.optimizer,
            "block_rows": self.block_rows,
            "bucket_size": self.bucket_size,
            "reshard_after_forward": self.reshard_after_forward,
            "params": self.params,
            "padding": {"elements": self.padding, "percent": 100 * self.padding / max(self.params, 1)},
            "buckets": {
                "count": sum(b.copies for b in self.buckets),
                "distinct": [
                    {"units": b.label, "copies": b.copies, "tensors": b.tensors, "numel": b.numel,
                     "shard_size": b.shard_size, "global_size": b.global_size, "padding": b.padding}
                    for b in self.buckets
                ],
            },
            "per_rank_bytes": self.per_rank_bytes(),
            "comm_bytes_per_rank": self.comm_bytes_per_rank(),
            "seconds": round(self.seconds, 3),
        }

    def settings(self) -> str:
        """Dtype, block and bucket settings, in words."""
        blocks = "element" if self.block_rows == 0 else f"{self.block_rows}-row"
        limit = "no bucket size limit" if self.bucket_size is None else f"buckets <= {self.bucket_size:,} elements"
        return f"{_dtype_name(self.param_dtype)} parameters, {blocks} blocks, {limit}"

    def to_text(self) -> str:
        m, r = self.shard_size, self.replicate_size
        mesh = f"{m} shards" if r == 1 else f"{r} replicas x {m} shards (HSDP)"
        if self.ep > 1:
            mesh += f", experts split over {self.ep} of them (EP)"
        if self.tp > 1:
            mesh += f" x {self.tp} tensor parallel"
        lines = [
            f"{self.model} on {self.world_size:,} ranks ({mesh}); {self.settings()}",
            f"parameters   {self.params:,} ({self.params / 1e9:.2f}B)",
            f"padding      {self.padding:,} elements ({100 * self.padding / max(self.params, 1):.4f}% of parameters)",
            f"buckets      {sum(b.copies for b in self.buckets)}; distinct:",
            f"  {'units':32s} {'tensors':>7s} {'elements':>15s} {'S (per rank)':>13s} {'padding':>10s}",
        ]
        for b in self.buckets:
            lines.append(f"  {b.label:32s} {b.tensors:7d} {b.numel:15,d} {b.shard_size:13,d} "
                         f"{100 * b.padding / max(b.numel, 1):9.4f}%")
        mem = self.per_rank_bytes()
        states = OPTIMIZER_STATES[self.optimizer]
        lines += [
            "per-rank memory (busiest rank, activations excluded)",
            f"  parameters       {_size(mem['params'])}",
            f"  gradients        {_size(mem['grads'])}",
            f"  optimizer        {_size(mem['optimizer'])}   ({self.optimizer}: {states} fp32 states per element)",
            f"  gathered (peak)  {_size(mem['gathered_peak'])}   "
            f"(largest bucket x{PREFETCHED_BUCKETS}: in use + prefetched)",
            f"  total            {_size(mem['total'])}",
        ]
        comm = self.comm_bytes_per_rank()
        lines += [
            "communication per step, bytes each rank sends (and receives), ring cost",
            f"  all_gather forward       {_size(comm['all_gather_forward'])}",
            f"  all_gather backward      {_size(comm['all_gather_backward'])}"
            f"   ({'reshard after forward' if self.reshard_after_forward else 'kept from forward'})",
            f"  reduce_scatter           {_size(comm['reduce_scatter'])}   "
            f"({_dtype_name(self.reduce_dtype)} gradients)",
        ]
        if r > 1:
            lines.append(f"  all_reduce (replicas)    {_size(comm['all_reduce_replicas'])}")
        lines += [f"  total                    {_size(comm['total'])}", f"planned in {self.seconds:.2f} s"]
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:10.3f} GiB ({nbytes:,} B)"


def _repeated_units(
    named: list[tuple[str, nn.Parameter]], blocks: dict[str, int]
) -> list[tuple[list[str], list[tuple[str, nn.Parameter]]]]:
    """The model's module units with identical ones collapsed: ``(unit names, parameters of the first)``.

    ``shard_parameters`` plans every unit on its own, so identical units (same parameter names
    within the unit, shapes, dtypes, trainability and blocks) get identical buckets: planning one
    copy of each is exact, and keeps a 61-layer model at 16384 ranks to seconds.
    """
    units: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        units.setdefault(unit_key(name), []).append((name, p))
    by_signature: dict[tuple, tuple[list[str], list[tuple[str, nn.Parameter]]]] = {}
    for unit, members in units.items():
        signature = tuple(
            (name.removeprefix(unit), tuple(p.shape), p.dtype, p.requires_grad, blocks[name]) for name, p in members
        )
        by_signature.setdefault(signature, ([], members))[0].append(unit)
    return list(by_signature.values())


def _least_padding_on_a_rank(buckets: list[tuple[DBuffer, int]], shard_ranks: int) -> int:
    """Fewest padding elements any one rank holds, summed over ``(bucket, copies)``."""
    padding_by_rank: dict[int, int] = {}
    for buf, copies in buckets:
        S, pos = buf.layout.shard_size, 0
        for name, size in buf.layout.segments():
            if name is None:
                for rank in range(pos // S, (pos + size - 1) // S + 1):
                    overlap = min(pos + size, (rank + 1) * S) - max(pos, rank * S)
                    padding_by_rank[rank] = padding_by_rank.get(rank, 0) + copies * overlap
            pos += size
    if len(padding_by_rank) < shard_ranks:
        return 0
    return min(padding_by_rank.values())


def plan_model(
    model: nn.Module,
    mesh_shape: tuple[int, ...],
    *,
    name: str = "model",
    bucket_size: int | None = None,
    block_rows: int = 0,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    reshard_after_forward: bool = True,
    tp: int = 1,
    ep: int = 1,
) -> PlanSummary:
    """Shard (a meta copy of) ``model`` as ``fully_shard`` would, on a fake mesh of ``mesh_shape``, and summarize.

    ``model`` itself is left untouched; it must not need a process group of its own. A 2-D
    ``mesh_shape`` is ``(replicate, shard)`` (HSDP). ``block_rows``: see :func:`block_elements`.
    ``tp``: tensor parallel ranks next to ``mesh_shape`` (Megatron column/row split of attention and
    MLP projections by name); ``ep``: expert parallel ranks taken from the shard ranks (stacked
    experts split on their first dim; per-expert modules dealt out, ``E/ep`` to each EP rank). Each parameter is then sharded over the ranks its split
    leaves (:class:`~fsdp_pass.sharding.mesh_roles.ParallelMesh`).
    """
    started = time.perf_counter()
    if len(mesh_shape) not in (1, 2) or min(mesh_shape) < 1:
        raise ValueError(f"mesh shape {mesh_shape} must be 1-D (FSDP) or 2-D (replicate, shard) of positive sizes")
    if tp < 1 or ep < 1 or mesh_shape[-1] % ep:
        raise ValueError(f"--ep {ep} must divide the shard ranks {mesh_shape[-1]}, and --tp {tp} must be >= 1")
    named = list(model.named_parameters())
    blocks = {n: block_elements(tuple(p.shape), block_rows) for n, p in named}
    units = _repeated_units(named, blocks)
    # Fresh meta parameters: the model is never touched, and nothing is allocated but the shards.
    distinct = [(n, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad))
                for _, members in units for n, p in members]
    units_of_param = {n: tuple(names) for names, members in units for n, _ in members}
    with fake_process_group(math.prod(mesh_shape) * tp):
        # fully_shard's sharding step without its initialization of meta parameters (planning needs no values).
        if tp == 1 and ep == 1:
            mesh = resolve_mesh(init_device_mesh("cpu", mesh_shape), argument="the planning mesh")
        else:
            mesh, distinct = _composed_mesh_and_parameters(mesh_shape, tp, ep, distinct)
            blocks.update({n: block_elements(tuple(p._local_tensor.shape), block_rows)
                           for n, p in distinct if hasattr(p, "_local_tensor")})
        buffers = shard_parameters(distinct, mesh, ShardingConfig(bucket_size, min_bucket_bytes=0), blocks)
        stats = [
            BucketStats(units_of_param[buf.names[0]], len(buf.names), buf.layout.numel, buf.layout.shard_size,
                        buf.mesh.shard_size, buf.dtype.itemsize, buf.shard.requires_grad, _split(buf))
            for buf in buffers
        ]
    trainable = [(buf, s.copies) for buf, s in zip(buffers, stats) if s.trainable]
    least_padding = _least_padding_on_a_rank(trainable, mesh_shape[-1])
    return PlanSummary(name, tuple(mesh_shape), param_dtype, reduce_dtype or param_dtype, optimizer, block_rows,
                       bucket_size, reshard_after_forward, tuple(stats), least_padding,
                       time.perf_counter() - started, tp, ep)


# Megatron tensor parallelism by parameter name: column-parallel (split outputs, dim 0) and
# row-parallel (split inputs, dim 1) projections.
_COLUMN_PARALLEL = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|wq|wk|wv|w1|w3)\.weight$")
_ROW_PARALLEL = re.compile(r"(o_proj|down_proj|wo|w2)\.weight$")
_STACKED_EXPERTS = re.compile(r"\.experts\.[A-Za-z_]")  # experts.gate_up_proj, not experts.3.up_proj
_EXPERT_MODULE = re.compile(r"^(.*\.experts\.)(\d+)\.")  # experts.3.up_proj: one module per expert


def _split(buf: DBuffer) -> int:
    """How many TP/EP ranks hold a different local part of the bucket's tensors (1: none)."""
    name = buf.names[0]
    spec = buf.dtensor_specs.get(name)
    return 1 if spec is None else spec.shape.numel() // buf.shapes[name].numel()


def _composed_mesh_and_parameters(mesh_shape: tuple[int, ...], tp: int, ep: int, params: list):
    """A named ``(rep, dp, ep, tp)`` mesh (size-1 dims left out) and the parameters as TP/EP DTensors."""
    from torch.distributed.tensor import DTensor, Shard

    sizes = {"rep": mesh_shape[0] if len(mesh_shape) == 2 else 1, "dp": mesh_shape[-1] // ep, "ep": ep, "tp": tp}
    names = tuple(n for n, size in sizes.items() if size > 1 or n == "dp")
    mesh = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=names)
    experts: dict[str, int] = {}  # per-expert modules: experts per MoE layer
    for name, _ in params:
        match = _EXPERT_MODULE.match(name)
        if match:
            experts[match.group(1)] = max(experts.get(match.group(1), 0), int(match.group(2)) + 1)
    composed = []
    for name, p in params:
        split = None
        module = _EXPERT_MODULE.match(name) if ep > 1 else None
        if module and experts[module.group(1)] % ep == 0:
            # Expert slot j of every EP rank (expert k*E/ep + j on rank k) planned as one tensor split
            # Shard(0) over EP: rank 0's experts stand for every rank's, which hold the same shapes.
            if int(module.group(2)) >= experts[module.group(1)] // ep:
                continue
            p = nn.Parameter(torch.empty((ep * p.shape[0], *p.shape[1:]), dtype=p.dtype, device="meta"),
                             requires_grad=p.requires_grad)
            split = ("ep", 0)
        elif ep > 1 and _STACKED_EXPERTS.search(name) and p.shape[0] % ep == 0:
            split = ("ep", 0)
        elif tp > 1 and _COLUMN_PARALLEL.search(name) and p.dim() == 2 and p.shape[0] % tp == 0:
            split = ("tp", 0)
        elif tp > 1 and _ROW_PARALLEL.search(name) and p.dim() == 2 and p.shape[1] % tp == 0:
            split = ("tp", 1)
        if split is not None:
            dim_name, dim = split
            local = list(p.shape)
            local[dim] //= sizes[dim_name]
            p = nn.Parameter(DTensor.from_local(torch.empty(local, dtype=p.dtype, device="meta"), mesh[dim_name],
                                                [Shard(dim)], run_check=False, shape=p.shape, stride=p.stride()),
                             requires_grad=p.requires_grad)
        composed.append((name, p))
    shard_dims = tuple(n for n in ("dp", "ep") if n in names)
    model_dims = tuple(n for n in ("ep", "tp") if n in names)
    replicate = "rep" if "rep" in names else None
    return resolve_mesh(mesh, shard_dims, "the planning mesh", replicate_dim=replicate, model_dims=model_dims), composed


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


def _run_plan(args: argparse.Namespace) -> int:
    mesh_shape = _mesh_shape(args)
    block_rows = args.block_rows if args.block_rows is not None else BLOCK_POLICIES[args.block_policy]
    param_dtype = DTYPES[args.param_dtype]
    options = dict(bucket_size=args.bucket_size, block_rows=block_rows, param_dtype=param_dtype,
                   reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                   optimizer=args.optimizer, reshard_after_forward=not args.no_reshard_after_forward)
    parallel = dict(tp=args.tp, ep=args.ep)
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
