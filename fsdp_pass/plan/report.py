"""The cost model behind ``python -m fsdp_pass plan``, and its rendering.

:func:`plan_model` shards a meta-device copy of a model as :func:`fsdp_pass.fully_shard` does (its
bucketing, planner and DBuffers, without initializing values) on a single-process fake process
group of any world size (no data, no collectives). The :class:`PlanSummary` it returns holds one
:class:`BucketStats` per distinct bucket and derives per-rank memory and communication bytes per
step from them; it renders as a text table (:meth:`PlanSummary.to_text`) or a JSON-ready dict
(:meth:`PlanSummary.to_dict`).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .parallel_rules import composed_mesh_and_parameters
from ..buckets.dbuffer import DBuffer
from ..buckets.mesh import check_reshard_group_size
from ..buckets.quantized_reduce import sent_bytes
from ..sharding.blocks import block_elements
from ..options import Fp8Options
from ..sharding.fp8_select import plan_fp8
from ..sharding.buckets import ShardingConfig, unit_key
from ..sharding.materialize import shard_with_blocks
from ..sharding.mesh_roles import resolve_mesh
from ..testing.fake_pg import fake_process_group

__all__ = ["DTYPES", "OPTIMIZER_STATES", "BucketStats", "PlanSummary", "bucket_stats", "plan_model"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # fp32 states per parameter element
OPTIMIZER_STATE_BYTES = 4
PREFETCHED_BUCKETS = 2  # the bucket in use plus the next one, gathered ahead


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
    fp8_bytes: int = 0  # FP8 all-gather: bytes each rank puts in (codes + scales); 0: gathered in param_dtype

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

    Inside and across nodes (:meth:`comm_bytes_by_link`): ranks are in nodes of ``node_size``
    consecutive ranks, shard groups are consecutive ranks, HSDP replicas are on other nodes; what a
    rank receives from each peer is counted where that peer lives (an all-gather of pieces of b bytes
    over g ranks: b from each of g - 1 peers). With ``reshard_after_forward=k`` backward gathers within
    groups of k ranks: k - 1 pieces of the bucket / k each ([Note: reshard within a node after forward]).
    """

    model: str
    mesh_shape: tuple[int, ...]
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer: str
    block_rows: int
    bucket_size: int | None
    reshard_after_forward: bool | int
    buckets: tuple[BucketStats, ...]
    least_padding_on_a_rank: int  # fewest padding elements one rank holds in trainable buckets
    seconds: float
    tp: int = 1  # tensor parallel ranks, next to mesh_shape
    ep: int = 1  # expert parallel ranks, part of the shard ranks
    fp8: bool = False  # --fp8: block weights all-gathered as FP8 codes + tile scales (docs/fp8.md)
    node_size: int = 8  # ranks per node: inside / across nodes in comm_bytes_by_link
    quantized_reduce_block: int | None = None  # --quantized-reduce: int8 codes + a float32 scale per block
    # shard groups spanning nodes gather and reduce across nodes, then within ([Note: collectives in two
    # levels across nodes] in buckets/node_collectives.py); False: one ring over the group (FSDP2's)
    two_level: bool = True

    def node_levels(self, group: int) -> tuple[int, int] | None:
        """(N nodes, L ranks on each) when a shard group of ``group`` consecutive ranks runs its collectives
        in two levels: it spans N > 1 whole nodes of L > 1 ranks; else None (one step)."""
        n = self.node_size
        if not self.two_level or n == 1 or group <= n or group % n:
            return None
        return group // n, n

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
        kept = self.kept_after_forward_bytes()
        return {"params": params, "grads": grads, "optimizer": optimizer, "gathered_peak": gathered,
                "kept_after_forward": kept, "total": params + grads + optimizer + gathered + kept}

    def kept_after_forward_bytes(self) -> int:
        """Gathered parameter bytes a rank holds from forward into backward, besides the last bucket (kept in
        every setting): none when resharding over all ranks, each bucket / k with k, each bucket with False."""
        k = self.reshard_after_forward
        if k is True:
            return 0
        resharded = self.buckets[:-1] if len(self.buckets) > 1 else self.buckets
        whole = sum(b.copies * b.global_size for b in resharded) * self.param_dtype.itemsize
        return whole if k is False else whole // k

    def comm_bytes_per_rank(self) -> dict[str, int]:
        """Bytes each rank sends per training step (it receives as many)."""
        out = {name: inside + across for name, (inside, across) in self.comm_bytes_by_link().items()}
        out["total"] = sum(out.values())
        if self.fp8:
            plain = self.param_dtype.itemsize
            out["all_gather_forward_without_fp8"] = sum(
                b.copies * (b.world_size - 1) * b.shard_size for b in self.buckets) * plain
        return out

    def comm_bytes_by_link(self) -> dict[str, tuple[int, int]]:
        """Per collective, the bytes a rank receives per step from peers (inside its node, on other nodes)."""
        plain, reduce = self.param_dtype.itemsize, self.reduce_dtype.itemsize
        r = self.replicate_size
        k = self.reshard_after_forward

        def peers(group: int) -> tuple[int, int]:  # (inside, across) peers of a group of consecutive ranks
            inside = min(group, self.node_size) - 1
            return inside, group - 1 - inside

        def add(total: list[int], group: int, piece: float, across_piece: float | None = None) -> None:
            """One collective of ``piece``-sized parts over ``group`` ranks (``across_piece``: what a part
            that crosses between nodes weighs, if not ``piece``: a quantized row)."""
            levels = self.node_levels(group)
            if levels is None:
                inside, across = peers(group)
            else:  # the N-1 pieces of its place from other nodes, then the node's others' N pieces each
                inside, across = levels[0] * (levels[1] - 1), levels[0] - 1
            total[0] += round(inside * piece)
            total[1] += round(across * (piece if across_piece is None else across_piece))

        forward, backward, scatter, grad_shards = [0, 0], [0, 0], [0, 0], 0
        for i, b in enumerate(self.buckets):
            piece = b.copies * (b.fp8_bytes or b.shard_size * plain)
            add(forward, b.world_size, piece)
            # backward gathers every bucket again but the last ([Note: the last bucket stays gathered into backward])
            if k is False or (i == len(self.buckets) - 1 and len(self.buckets) > 1):
                pass
            elif k is True or b.world_size <= k:
                add(backward, b.world_size, piece)
            else:  # the bucket / k from each of the k - 1 others of the group (param_dtype: kept dequantized)
                add(backward, k, b.copies * b.global_size * plain / k)
            if b.trainable and self.quantized_reduce_block and b.world_size > 1:
                # [Note: block-quantized gradient reduction]: one row of codes + scales to each other rank
                row = b.copies * sent_bytes(2, b.shard_size, self.quantized_reduce_block)
                # in two levels the node's exact sums travel within it in reduce_dtype, only rows cross
                within = b.copies * b.shard_size * reduce if self.node_levels(b.world_size) else row
                add(scatter, b.world_size, within, across_piece=row)
            elif b.trainable:
                add(scatter, b.world_size, b.copies * b.shard_size * reduce)
                grad_shards += b.copies * b.shard_size * reduce
        return {"all_gather_forward": tuple(forward), "all_gather_backward": tuple(backward),
                "reduce_scatter": tuple(scatter), "all_reduce_replicas": (0, 2 * (r - 1) * grad_shards // r)}

    def bytes_between_nodes(self, reduce_scatter_as_all_reduce: bool = False) -> dict[str, int]:
        """Per collective, the bytes that cross between nodes per step, all nodes together, when the
        collectives run as rings over consecutive ranks (gloo, NCCL's ring algorithm): what the nodes'
        network counters see, where :meth:`comm_bytes_by_link` counts what each rank must receive.

        [Note: ring collectives across nodes]
        A ring over g consecutive ranks spanning c > 1 nodes crosses between nodes on c of its g edges
        (from each node's last rank to the next node's first, and back around). An all-gather of pieces
        of b bytes sends g - 1 pieces over every edge; a ring all-reduce of B bytes sends 2(g-1)/g · B; a
        ring reduce-scatter g - 1 pieces; gloo's reduce-scatter is an all-reduce of the whole input
        (``reduce_scatter_as_all_reduce``: B = g · b). An all-to-all goes straight from each rank to each
        other: g · (peers on other nodes) rows. Groups inside one node cross nothing. In two levels
        (``two_level``, N nodes of L ranks) only the across-node step crosses: L rings (or all-to-alls)
        of N ranks, one on each node, all of whose edges cross. Measured on gloo over a node lab
        (docs/benchmarks.md, "Two nodes over a real link").
        """
        plain, reduce = self.param_dtype.itemsize, self.reduce_dtype.itemsize
        n, r, k = self.node_size, self.replicate_size, self.reshard_after_forward
        groups = self.replicate_size  # shard groups, one per replica: consecutive ranks

        def crossings(group: int) -> int:
            spanned = -(-group // n)
            return spanned if spanned > 1 else 0

        def gather(group: int, piece: float) -> float:
            levels = self.node_levels(group)
            if levels is not None:  # L rings of N ranks, one on each node: every edge crosses
                nodes, per_node = levels
                return per_node * nodes * (nodes - 1) * piece
            return crossings(group) * (group - 1) * piece

        def reduce_scatter(group: int, piece: float) -> float:
            # a ring reduce-scatter crosses as the all-gather does; gloo's all-reduce of the whole input twice that
            return (2 if reduce_scatter_as_all_reduce else 1) * gather(group, piece)

        forward = backward = scatter = replicas = 0.0
        for i, b in enumerate(self.buckets):
            piece = b.copies * (b.fp8_bytes or b.shard_size * plain)
            forward += groups * gather(b.world_size, piece)
            if k is False or (i == len(self.buckets) - 1 and len(self.buckets) > 1):
                pass
            elif k is True or b.world_size <= k:
                backward += groups * gather(b.world_size, piece)
            else:  # groups of k consecutive ranks, k - 1 pieces of bucket / k each
                backward += groups * b.world_size // k * gather(k, b.copies * b.global_size * plain / k)
            if not b.trainable or b.world_size == 1:
                continue
            if self.quantized_reduce_block:
                row = b.copies * sent_bytes(2, b.shard_size, self.quantized_reduce_block)
                levels = self.node_levels(b.world_size)
                if levels is None:  # one all-to-all: each rank to every rank on other nodes
                    scatter += groups * b.world_size * (b.world_size - min(b.world_size, n)) * row
                else:  # L all-to-alls of N ranks, one on each node
                    scatter += groups * levels[1] * levels[0] * (levels[0] - 1) * row
            else:
                scatter += groups * reduce_scatter(b.world_size, b.copies * b.shard_size * reduce)
            if r > 1:  # one replica group per shard rank, each rank of it on another node
                replicas += b.world_size * r * 2 * (r - 1) / r * b.copies * b.shard_size * reduce
        out = {"all_gather_forward": forward, "all_gather_backward": backward, "reduce_scatter": scatter,
               "all_reduce_replicas": replicas}
        out = {name: round(v) for name, v in out.items()}
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
            "quantized_reduce_block": self.quantized_reduce_block,
            "two_level": self.two_level,
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
            "node_size": self.node_size,
            "comm_bytes_by_link": {name: {"inside_node": inside, "across_nodes": across}
                                   for name, (inside, across) in self.comm_bytes_by_link().items()},
            "seconds": round(self.seconds, 3),
        }

    def settings(self) -> str:
        """Dtype, block and bucket settings, in words."""
        blocks = "element" if self.block_rows == 0 else f"{self.block_rows}-row"
        limit = "no bucket size limit" if self.bucket_size is None else f"buckets <= {self.bucket_size:,} elements"
        fp8 = ", FP8 all-gather of block weights" if self.fp8 else ""
        return f"{_dtype_name(self.param_dtype)} parameters, {blocks} blocks, {limit}{fp8}"

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
            f"  kept after fwd   {_size(mem['kept_after_forward'])}   ({self._backward_gathers()})",
            f"  total            {_size(mem['total'])}",
        ]
        comm = self.comm_bytes_per_rank()
        lines += [
            "communication per step, bytes each rank sends (and receives), ring cost",
            f"  all_gather forward       {_size(comm['all_gather_forward'])}"
            + (f"   (without FP8: {_size(comm['all_gather_forward_without_fp8'])})" if self.fp8 else ""),
            f"  all_gather backward      {_size(comm['all_gather_backward'])}"
            f"   ({self._backward_gathers()})",
            f"  reduce_scatter           {_size(comm['reduce_scatter'])}   "
            f"({self._reduced_as()})",
        ]
        if r > 1:
            lines.append(f"  all_reduce (replicas)    {_size(comm['all_reduce_replicas'])}")
        lines.append(f"  total                    {_size(comm['total'])}")
        by_link = self.comm_bytes_by_link()
        inside, across = (sum(v[i] for v in by_link.values()) for i in (0, 1))
        lines += [f"  of it from ranks inside the node ({self.node_size} ranks): {_size(inside)}",
                  f"  of it from other nodes:                   {_size(across)}",
                  f"    all_gather backward across nodes:       {_size(by_link['all_gather_backward'][1])}",
                  f"planned in {self.seconds:.2f} s"]
        return "\n".join(lines)


    def _reduced_as(self) -> str:
        if self.quantized_reduce_block:
            return f"int8 codes + 1 fp32 scale per {self.quantized_reduce_block} elements"
        return f"{_dtype_name(self.reduce_dtype)} gradients"

    def _backward_gathers(self) -> str:
        k = self.reshard_after_forward
        if k is True:
            return "reshard after forward"
        return "kept from forward" if k is False else f"reshard after forward to groups of {k} ranks"


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


def bucket_stats(buf: DBuffer, units: tuple[str, ...]) -> BucketStats:
    """A sharded bucket as the cost model counts it; ``units``: the module units whose copy it stands for."""
    return BucketStats(units, len(buf.names), buf.layout.numel, buf.layout.shard_size, buf.mesh.shard_size,
                       buf.dtype.itemsize, buf.shard.requires_grad, _split(buf), _fp8_bytes(buf))


def _split(buf: DBuffer) -> int:
    """How many TP/EP ranks hold a different local part of the bucket's tensors (1: none)."""
    name = buf.names[0]
    spec = buf.dtensor_specs.get(name)
    return 1 if spec is None else spec.shape.numel() // buf.shapes[name].numel()


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
    reshard_after_forward: bool | int = True,
    tp: int = 1,
    ep: int = 1,
    fp8: bool = False,
    node_size: int = 8,
    quantized_reduce_block: int | None = None,
    two_level: bool = True,
) -> PlanSummary:
    """Shard (a meta copy of) ``model`` as ``fully_shard`` would, on a fake mesh of ``mesh_shape``, and summarize.

    ``model`` itself is left untouched; it must not need a process group of its own. A 2-D
    ``mesh_shape`` is ``(replicate, shard)`` (HSDP). ``block_rows``: see :func:`fsdp_pass.sharding.blocks.block_elements`.
    ``tp``: tensor parallel ranks next to ``mesh_shape`` (Megatron column/row split of attention and
    MLP projections by name); ``ep``: expert parallel ranks taken from the shard ranks (stacked
    experts split on their first dim; per-expert modules dealt out, ``E/ep`` to each EP rank); the
    rules are :mod:`fsdp_pass.plan.parallel_rules`. Each parameter is then sharded over the ranks its split
    leaves (:class:`~fsdp_pass.sharding.mesh_roles.ParallelMesh`). ``fp8``: the weights
    ``options={"fp8_all_gather": True}`` selects get 128-row blocks and FP8 buckets (docs/fp8.md).
    ``reshard_after_forward``: True, False or a group size k (checked against the shard ranks);
    ``node_size``: ranks per node, for the communication inside and across nodes.
    ``quantized_reduce_block``: gradients reduce-scatter as int8 codes + a scale per this many elements
    (``options["quantized_reduce"]``). ``two_level``: shard groups spanning nodes gather and reduce in two
    levels, as fsdp_pass does under a launcher that reports its nodes (False: one ring, FSDP2's).
    """
    started = time.perf_counter()
    if len(mesh_shape) not in (1, 2) or min(mesh_shape) < 1:
        raise ValueError(f"mesh shape {mesh_shape} must be 1-D (FSDP) or 2-D (replicate, shard) of positive sizes")
    if not isinstance(reshard_after_forward, bool):
        check_reshard_group_size(reshard_after_forward, mesh_shape[-1], "--reshard-after-forward")
    if node_size < 1:
        raise ValueError(f"--node-size {node_size} must be a positive number of ranks per node, e.g. 8")
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
            mesh, distinct = composed_mesh_and_parameters(mesh_shape, tp, ep, distinct)
            blocks.update({n: block_elements(tuple(p._local_tensor.shape), block_rows)
                           for n, p in distinct if hasattr(p, "_local_tensor")})
        fp8_plan = plan_fp8(distinct, Fp8Options() if fp8 else None, "--fp8")
        buffers = shard_with_blocks(distinct, mesh, ShardingConfig(bucket_size, min_bucket_bytes=0), blocks, fp8_plan)
        stats = [bucket_stats(buf, units_of_param[buf.names[0]]) for buf in buffers]
    trainable = [(buf, s.copies) for buf, s in zip(buffers, stats) if s.trainable]
    least_padding = _least_padding_on_a_rank(trainable, mesh_shape[-1])
    return PlanSummary(name, tuple(mesh_shape), param_dtype, reduce_dtype or param_dtype, optimizer, block_rows,
                       bucket_size, reshard_after_forward, tuple(stats), least_padding,
                       time.perf_counter() - started, tp, ep, fp8, node_size, quantized_reduce_block, two_level)


def _fp8_bytes(buf: DBuffer) -> int:
    """Bytes one rank puts into an FP8 bucket's all-gather: codes (rounded up to 4) + its scale slots."""
    if not buf.fp8_tile:
        return 0
    return -(-buf.layout.shard_size // 4) * 4 + 4 * buf.fp8_gather().scale_slots
