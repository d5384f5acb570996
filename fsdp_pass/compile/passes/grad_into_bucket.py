"""Pass 5 (backward graphs): gradients are produced in the bucket gradient, not copied into it.

[Note: gradients written into the bucket]
A bucket's parameters are views of one gathered buffer (compile/passes/rewrite.py), so autograd hands the
reduce-scatter the bucket gradient as ``cat`` of every parameter's gradient: a copy of the whole
bucket, every step, and for a moment twice its memory. Inductor writes a pointwise or reduction
producer straight into a ``cat``'s output, but not an extern kernel: the matmuls that make every
weight gradient. This pass rewrites each such ``cat`` (one whose inputs are the bucket's segments)
into the bucket gradient itself:

    buf = empty(bucket size)                          where the bucket's first gradient is made
    matmul_into(buf, offset, a, b, dims)              instead of  mm/bmm(a, b) [→ permute → clone] → view
    copy_(slice(buf, offset, offset + n), grad)       any other gradient (Inductor fuses pointwise ones)
    reduce_scatter(buf)                               instead of  reduce_scatter(cat(...))

``matmul_into`` (buckets/matmul_into.py) runs the same ``mm``/``bmm`` with ``out=`` a strided view of
the slice, so values are bitwise those of the ``cat`` graph; a transposed product (a stacked-expert
weight's ``bmm`` then ``permute``) is written through a permuted view, where BLAS may sum in another order
([Note: products written through a transposed target]). The gradients that are still
copied (reductions under Inductor, which compute into a scratch first; every non-matmul gradient
under aot_eager; producers this pass does not know) are recorded on their bucket's
``DBuffer.gradient_copies``, which ``explain()`` prints. The graph order is kept: each write takes
its producer's place, and the collective stays where the schedule put it (the pass runs after
compile/passes/schedule.py; Inductor orders readers of a mutated buffer after the mutation).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from ...buckets.dbuffer import DBuffer
from ...buckets.matmul_into import matmul_into

__all__ = ["write_gradients_into_buckets"]

_aten = torch.ops.aten
_FLATTENING = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
# Ops that reorder a tensor's elements (a clone only copies them).
_REORDERING = {_aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.clone.default}
_REARRANGING = _FLATTENING | _REORDERING  # what lies between a producer and its flat segment
_MATMULS = {_aten.mm.default: 2, _aten.bmm.default: 3}
_REDUCTIONS = {_aten.sum.dim_IntList, _aten.sum.default, _aten.mean.dim, _aten.amax.default, _aten.amin.default}
# Ops Inductor runs as library calls into buffers of their own (and matmuls this pass could not rewrite).
_EXTERN = {_aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default,
           _aten.convolution.default, _aten.convolution_backward.default}
_CONSTANTS = {_aten.full.default, _aten.zeros.default, _aten.scalar_tensor.default}


@dataclass
class _InPlace:
    """A segment whose producer writes into the bucket: ``matmul`` (mm/bmm), stored as its product
    viewed as ``stored`` then permuted by ``dims`` (both empty: the product as it is)."""

    matmul: fx.Node
    stored: list[int]
    dims: list[int]
    chain: list[fx.Node]  # the nodes from the flat segment back to (not including) the matmul: erased


def _val(node: fx.Node) -> torch.Tensor | None:
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _sole_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def _in_place_producer(segment: fx.Node) -> _InPlace | None:
    """``segment`` = the product of an ``mm|bmm`` through reshapes, permutes (``t``, ``transpose``,
    ``permute``) and clones, each node used once; None for any other producer."""
    chain, cur = [], segment
    while (cur.op == "call_function" and _sole_user(cur) and isinstance(cur.args[0], fx.Node)
           and cur.target in _REARRANGING):
        chain.append(cur)
        cur = cur.args[0]
    product = _val(cur)
    if not (chain and cur.op == "call_function" and cur.target in _MATMULS and _sole_user(cur)
            and product is not None and product.dim() == _MATMULS[cur.target]):
        return None
    # Replay the chain from the product on values (memory layouts do not matter: a reshape reads
    # row-major, a clone changes nothing): the segment is ``product.view(base).permute(dims)``
    # flattened. A reshape of a permuted tensor keeps its element order (``frozen``); a permute
    # after it could not be written this way.
    base, dims, frozen = list(product.shape), list(range(product.dim())), False
    for node in reversed(chain):
        if node.target in _FLATTENING:
            if dims == sorted(dims):
                base, dims = list(_val(node).shape), list(range(_val(node).dim()))
            else:
                frozen = True
        elif node.target is not _aten.clone.default:  # clones only materialize the order
            if frozen:
                return None
            ndim = len(dims)
            if node.target is _aten.permute.default:
                dims = [dims[d % ndim] for d in node.args[1]]
            else:  # t / transpose.int: swap two dims
                a, b = node.args[1:3] if node.target is _aten.transpose.int else (0, 1)
                dims[a % ndim], dims[b % ndim] = dims[b % ndim], dims[a % ndim]
    if dims == sorted(dims):
        return _InPlace(cur, [], [], chain)
    stored = [base[d] for d in dims]
    try:  # the product's shape must be a view of the permuted slice for ``out=`` to write in place
        torch.empty(stored, device="meta").permute([dims.index(d) for d in range(len(dims))]).view(product.shape)
    except RuntimeError:
        return None
    return _InPlace(cur, stored, dims, chain)


def _producer(node: fx.Node) -> fx.Node:
    """The op that computes ``node``'s values: views and reorders skipped, a multi-output op's item
    (``convolution_backward``'s weight gradient) traced to the op."""
    while node.op == "call_function" and (node.target in _REARRANGING or node.target is operator.getitem):
        node = node.args[0]
    return node


def _copy_cost(source: fx.Node, inductor: bool) -> str | None:
    """Why writing ``source`` into its slice is a copy; None when it is not (a fill, or under
    Inductor a pointwise producer, which it fuses into the store)."""
    producer = _producer(source)
    if producer.op == "call_function" and producer.target in _CONSTANTS:
        return None  # padding: a fill
    if not inductor:
        return f"{producer.name} is computed, then copied (aot_eager runs each op on its own)"
    if producer.op != "call_function":
        return f"{producer.name} is a graph input, copied"
    if producer.target in _REDUCTIONS:
        return f"{producer.name} is a reduction: Inductor computes it into a scratch buffer, then copies it"
    if producer.target in _EXTERN or getattr(producer.target, "namespace", "aten") != "aten":
        return f"{producer.name} ({producer.target}) is an extern kernel, which Inductor cannot write into a slice"
    return None


def _bucket_gradients(graph: fx.Graph, buffers: Sequence[DBuffer]) -> list[tuple[fx.Node, DBuffer]]:
    """The ``cat`` nodes that build a bucket's whole gradient, each with its bucket. A ``cat`` is one
    when its inputs are 1-D and sized as a bucket's segments; identical buckets (repeated layers) are
    told apart by order: backward meets them in the reverse of the forward's order."""
    candidates: dict[tuple[int, ...], list[DBuffer]] = {}
    for buf in buffers:
        candidates.setdefault(tuple(buf.segment_sizes()), []).append(buf)
    found = []
    for cat in graph.find_nodes(op="call_function", target=_aten.cat.default):
        inputs = cat.args[0]
        if (len(cat.args) > 1 and cat.args[1] != 0) or not all(isinstance(x, fx.Node) for x in inputs):
            continue
        vals = [_val(x) for x in inputs]
        if any(v is None or v.dim() != 1 for v in vals):
            continue
        same = candidates.get(tuple(v.numel() for v in vals))
        if same:
            found.append((cat, same.pop() if len(same) > 1 else same[0]))
    return found


def write_gradients_into_buckets(gm: fx.GraphModule, buffers: Sequence[DBuffer], inductor: bool) -> fx.GraphModule:
    """Rewrite ``gm`` (a backward graph) per [Note: gradients written into the bucket]; records the
    gradients still copied on ``DBuffer.gradient_copies``."""
    graph = gm.graph
    changed = False
    for cat, bucket in _bucket_gradients(graph, buffers):
        order = {n: i for i, n in enumerate(graph.nodes)}
        segments = list(cat.args[0])
        producers = [_in_place_producer(x) for x in segments]
        if len(segments) == 1 and producers[0] is None:  # a cat of one: the segment is the gradient
            cat.replace_all_uses_with(segments[0])
            graph.erase_node(cat)
            changed = True
            continue
        if not any(producers):  # Inductor writes non-matmul producers into a cat's output itself
            continue
        whole = _val(cat)
        first = min([p.matmul if p else x for p, x in zip(producers, segments)], key=order.__getitem__)
        with graph.inserting_before(first):
            buf = graph.call_function(_aten.empty.memory_format, ([whole.numel()],),
                                      {"dtype": whole.dtype, "device": whole.device})
        buf.meta["val"] = whole
        offset, dead = 0, []
        names = [name for name, _ in bucket.layout.segments()]
        for segment, producer, name in zip(segments, producers, names):
            n = _val(segment).numel()
            if producer is not None:
                with graph.inserting_before(producer.matmul):
                    write = graph.call_function(matmul_into._opoverload,
                                                (buf, offset, *producer.matmul.args, producer.stored,
                                                 producer.dims))
                write.meta["val"] = None
                dead += producer.chain + [producer.matmul]
            else:
                with graph.inserting_after(segment):
                    part = graph.call_function(_aten.slice.Tensor, (buf, 0, offset, offset + n))
                with graph.inserting_after(part):
                    write = graph.call_function(_aten.copy_.default, (part, segment))
                part.meta["val"] = write.meta["val"] = whole[offset:offset + n]
                why = _copy_cost(segment, inductor)
                if why is not None and name is not None:
                    bucket.gradient_copies[name] = f"{why} ({n * whole.element_size()} B)"
            offset += n
        cat.replace_all_uses_with(buf)
        graph.erase_node(cat)
        for node in dead:  # chain nodes first (users before producers)
            graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
