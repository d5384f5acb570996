"""``explain(model)``: the plan and the graphs of a model compiled with the vescale backend."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .backend import records
from ..buckets.dbuffer import DBuffer, buffers_of
from ..options import Options

__all__ = ["Explanation", "explain"]


@dataclass
class Explanation:
    """The buckets of a sharded model and the graphs the backend produced for it."""

    buffers: list[DBuffer]
    graphs: list[dict[str, str]] = field(default_factory=list)  # one dict per compiled graph: stage → code
    across_step: list[str] = field(default_factory=list)  # communication the graphs leave across the step
    reductions: list[str] = field(default_factory=list)  # how the graphs reduce gradients, where not plainly
    outlined: list[str] = field(default_factory=list)  # blocks compiled once, and blocks left flat with why
    eager: list[str] = field(default_factory=list)  # parameters no compiled graph reads, and Dynamo's graph breaks

    def bytes_per_rank(self) -> dict[str, int]:
        """Parameter and gradient bytes each rank holds (padding included)."""
        params = sum(b.layout.shard_size * b.dtype.itemsize for b in self.buffers)
        grads = sum(b.layout.shard_size * b.dtype.itemsize for b in self.buffers if b.shard.requires_grad)
        return {"params": params, "grads": grads}

    def plan_text(self) -> str:
        lines = []
        for b in self.buffers:
            m = b.mesh
            lines.append(
                f"bucket {b.index}: {len(b.names)} params, dtype {b.dtype}, S={b.layout.shard_size} x "
                f"{m.shard_size} ranks (replicated x{m.replicate_size}), padding {b.layout.padding} "
                f"({b.layout.padding / max(b.layout.global_size, 1):.2%})"
                + (f", FP8 all-gather (tile {b.fp8_tile})" if b.fp8_tile else "")
            )
            for name in b.names:
                lo, hi = b.layout.global_range(name)
                placement = str(b.placement(name))
                spec = b.dtensor_specs.get(name)
                if spec is not None:  # [Note: FSDP over TP/EP]: TP/EP first, then FSDP on the local tensor
                    dims = ", ".join(f"{pl} over {d}" for pl, d in zip(spec.placements, spec.mesh.mesh_dim_names))
                    placement = f"{dims} of {tuple(spec.shape)}, then {placement}"
                lines.append(f"    {name:40s} {tuple(b.shapes[name])!s:18s} [{lo}, {hi})  {placement}")
        for b in self.buffers:  # [Note: FP8 all-gather]: candidates kept in param_dtype
            for name, why in b.fp8_skipped.items():
                lines.append(f"fp8_all_gather left out: {name} ({why})")
        for b in self.buffers:  # [Note: gradients written into the bucket]
            for name, why in b.gradient_copies.items():
                lines.append(f"gradient copied into bucket {b.index}: {name}: {why}")
        per_rank = self.bytes_per_rank()
        lines.append(f"per rank: parameters {per_rank['params']} B, gradients {per_rank['grads']} B")
        lines.append(
            f"collectives per step: forward all_gather x{len(self.buffers)}, backward reduce_scatter "
            f"x{sum(b.shard.requires_grad for b in self.buffers)} (plus backward all_gathers when resharding)"
        )
        lines += _two_level_lines(self.buffers)
        lines += [f"across the step: {line}" for line in dict.fromkeys(self.across_step)]
        lines += list(dict.fromkeys(self.reductions))
        lines += self.outlined  # [Note: repeated blocks compiled once]
        lines += self.eager  # [Note: parameters no graph reads]
        return "\n".join(lines)

    def __str__(self) -> str:
        parts = [self.plan_text()]
        for i, graphs in enumerate(self.graphs):
            for stage, code in graphs.items():
                parts.append(f"===== graph {i}: {stage} =====\n{code}")
        return "\n".join(parts)


def _two_level_lines(buffers: list[DBuffer]) -> list[str]:
    """Which buckets gather and reduce in two levels, over how many nodes ([Note: collectives in two levels
    across nodes] in buckets/node_collectives.py)."""
    spans: dict[tuple[int, int], list[int]] = {}
    for b in buffers:
        levels = b.mesh.node_levels()
        if levels is not None:
            spans.setdefault((levels.nodes, levels.per_node), []).append(b.index)
    return [f"collectives in two levels: buckets {indices} span {nodes} nodes of {per_node} ranks: all_gather "
            f"across the nodes, then within each; reduce_scatter within each node, then across"
            for (nodes, per_node), indices in spans.items()]


def _quantized_reduce_lines(options: Options, buffers: list[DBuffer]) -> list[str]:
    """Per bucket of a graph compiled with ``quantized_reduce``: whether its reduce-scatter is quantized, or
    why not ([Note: block-quantized gradient reduction])."""
    q = options.quantized_reduce
    if q is None:
        return []
    rounding = "stochastic rounding" if q.stochastic else "round to nearest"
    lines = []
    for b in buffers:
        if not b.shard.requires_grad:
            why = "not quantized: frozen, no gradient to reduce"
        elif b.mesh.shard_size == 1:
            why = "not quantized: sharded over one rank, no reduce-scatter"
        else:
            why = f"int8 codes + 1 float32 scale per {q.block} elements ({rounding}), one all_to_all"
            if b.mesh.node_levels() is not None:
                why += " across the nodes, of the node's exact sums"
            if b.mesh.replicate_size > 1:
                why += f"; the all-reduce over {b.mesh.replicate_size} replicas stays exact"
        lines.append(f"gradient reduce-scatter of bucket {b.index}: {why}")
    return lines


_LISTED = 8  # parameter names an eager line lists before "..."


def _eager_lines(buffers: list[DBuffer], mine: list) -> list[str]:
    """The parameters no compiled graph reads, and why code ran outside the graphs: the graph breaks that ended
    this model's graphs, and those Dynamo counted in this process (a frame it gave up on whole is counted
    there only). [Note: parameters no graph reads] in compile/passes/unread.py."""
    outside = [name for b in buffers for name in b.names if name not in b.compiled_reads]
    if not outside:
        return []
    listed = ", ".join(outside[:_LISTED]) + (", ..." if len(outside) > _LISTED else "")
    lines = [f"outside the compiled graphs: {len(outside)} parameters ({listed}) no compiled graph reads; they run "
             f"through the eager path when used (their bucket gathered, gradients reduce-scattered into the shards)"]
    lines += [f"graph break: graph {i} ends at {_first_line(r.graph_break)}" for i, r in enumerate(mine) if r.graph_break]
    for reason, count in torch._dynamo.utils.counters["graph_break"].items():
        hints = [line.strip() for line in reason.splitlines() if line.strip().startswith("Hint:")]
        lines.append(f"graph break (Dynamo, x{count}): {_first_line(reason)}" + (f" ({' '.join(hints)})" if hints else ""))
    if len(lines) == 1:
        lines.append("graph break: none recorded (a branch not taken yet, a module called eagerly, or a model sharded "
                     "by fully_shard and compiled in parts)")
    return lines


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


def explain(model: nn.Module, print_output: bool = True) -> Explanation:
    """Describe the plan (buckets, offsets, placements, padding, bytes per rank, collectives) and graphs."""
    module = getattr(model, "_orig_mod", model)
    buffers = buffers_of(module)
    if not buffers:
        raise ValueError(
            "explain() found no sharded parameters; compile the model with torch.compile(model, "
            "backend='vescale') and run it once (or call fsdp_pass.fully_shard) first"
        )
    ids = {id(b) for b in buffers}
    mine = [r for r in records() if any(id(b) in ids for b in r.buffers)]
    result = Explanation(sorted(buffers, key=lambda b: b.index), [r.graphs for r in mine],
                         [line for r in mine for line in r.across_step],
                         [line for r in mine for line in _quantized_reduce_lines(r.options, r.buffers)],
                         [f"graph {i}: {line}" for i, r in enumerate(mine) for line in r.outlined.lines()],
                         _eager_lines(buffers, mine))
    if print_output:
        print(result)
    return result


