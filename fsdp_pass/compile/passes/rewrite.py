"""Pass 3: replace parameter placeholders by views of their gathered bucket.

For each bucket the graph uses, one new placeholder (the bucket's flat shard) and, right before the
first use of any of its parameters::

    shard ─ gather_bucket ─ split_with_sizes ─ getitem ─ view(shape)   (one view per parameter)

``gather_bucket`` all-gathers in forward and reduce-scatters in backward (buckets/gather.py); the
views are zero-copy because every parameter is a contiguous slice of the gathered buffer. The
parameter placeholders are removed: the compiled function takes the shards instead.

The backend's compiled variants (compile/backend.py) are the rewritten graph with these transforms
applied in sequence, each on a copy: :func:`hand_out_gradients` gives some trainable buckets one more
placeholder, ``bucketN_pending``, passed to their ``gather_bucket`` as ``pending=`` (gradient
accumulation without sync, [Note: gradient accumulation without sync] in buckets/dbuffer.py, and the
deferred reduce, step/deferred_reduce.py); :func:`take_prefetched` makes some buckets' gathers take
the buffer handed over to the call ([Note: the next step's first gather starts at the optimizer
step] in step/prefetch.py).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, replace
from typing import Collection, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ...buckets.dbuffer import DBuffer
from ...buckets.gather import GatherConfig, gather_bucket
from ...options import QuantizedReduce
from .detect import ParamSite

__all__ = ["Rewritten", "copy_dynamo_graph", "hand_out_gradients", "rewrite_parameters", "take_prefetched"]


@dataclass
class Rewritten:
    gm: fx.GraphModule
    buffers: list[DBuffer]  # one new leading input per bucket, in this order
    configs: list[GatherConfig]  # each bucket's gather arguments in the graph
    dropped: list[int]  # positions of the original inputs that were parameters


def copy_dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph that keeps what aot_autograd reads (Dynamo still owns the original)."""
    graph = copy.deepcopy(gm.graph)
    new = fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    for old_node, new_node in zip(gm.graph.nodes, graph.nodes):
        if old_node.op == "placeholder":
            new_node._dynamo_source = getattr(old_node, "_dynamo_source", None)
    return new


def _as_dtensor(spec: DTensorSpec):
    """A graph-callable that rebuilds a parameter's DTensor around its gathered local view
    (see [Note: FSDP over TP/EP]; the spec is held in a closure: FX can name a function, not a mesh)."""

    def as_dtensor(local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                  stride=spec.stride)

    return as_dtensor


def rewrite_parameters(
    gm: fx.GraphModule,
    sites: Sequence[ParamSite],
    buckets: Mapping[str, tuple[DBuffer, str]],
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    quantized_reduce: QuantizedReduce | None = None,
) -> Rewritten:
    """Rewrite ``gm`` (a copy, see :func:`copy_dynamo_graph`) in place; ``buckets`` maps FQN → (DBuffer, name).
    ``quantized_reduce``: the buckets' gradients reduce-scatter block-quantized ([Note: block-quantized
    gradient reduction])."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = list(graph.find_nodes(op="placeholder"))

    used: dict[int, list[ParamSite]] = {}
    buffers: dict[int, DBuffer] = {}
    for site in sites:
        buf, _ = buckets[site.name]
        used.setdefault(id(buf), []).append(site)
        buffers[id(buf)] = buf

    first_input = placeholders[0]
    new_inputs: list[DBuffer] = []
    configs: list[GatherConfig] = []
    for key, members in used.items():
        buf = buffers[key]
        users = [u for s in members for u in placeholders[s.index].users]
        if not users:  # parameters the graph never reads: nothing to gather
            continue
        with graph.inserting_before(first_input):
            shard = graph.placeholder(f"bucket{len(new_inputs)}_shard")
        shard._dynamo_source = None
        shard.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
        new_inputs.append(buf)
        config = buf.config(param_dtype or buf.param_dtype, reduce_dtype or buf.reduce_dtype, fp8=True,
                            quantized_reduce=quantized_reduce)
        configs.append(config)
        kwargs = config._asdict()
        for optional in ("fp8", "quantized_reduce"):  # named only where used: plain graphs read as before
            if kwargs[optional] is None:
                del kwargs[optional]
        with graph.inserting_before(min(users, key=order.__getitem__)):
            full = graph.call_function(gather_bucket, (shard,), kwargs)
            full.meta["example_value"] = _gathered_example(placeholders[members[0].index], config.param_dtype,
                                                           [sum(buf.segment_sizes())])
            pieces = graph.call_function(torch.ops.aten.split_with_sizes.default, (full, buf.segment_sizes()))
            for site in members:
                _, name = buckets[site.name]
                piece = graph.call_function(operator.getitem, (pieces, buf.segment_index(name)))
                view = graph.call_function(torch.ops.aten.view.default, (piece, list(buf.shapes[name])))
                view.meta["example_value"] = _gathered_example(placeholders[site.index], config.param_dtype)
                spec = buf.dtensor_specs.get(name)
                if spec is not None:
                    view = graph.call_function(_as_dtensor(spec), (view,))
                placeholders[site.index].replace_all_uses_with(view)
    for site in sites:
        graph.erase_node(placeholders[site.index])
    graph.lint()
    gm.recompile()
    return Rewritten(gm, new_inputs, configs, [s.index for s in sites])


def _gathered_example(param: fx.Node, dtype: torch.dtype, size: list[int] | None = None):
    """The (fake) value of a parameter's gathered view: Dynamo's example of the parameter in ``dtype``;
    with ``size``, of its gathered bucket, made like it (the outline pass compares blocks by their
    operands' examples)."""
    example = param.meta.get("example_value")
    if not isinstance(example, torch.Tensor) or isinstance(example, DTensor):
        return None if size is not None else example
    if size is not None:
        return example.new_empty(size, dtype=dtype)
    return example.to(dtype) if example.dtype != dtype else example


def hand_out_gradients(rewritten: Rewritten, buckets: Collection[int]) -> Rewritten:
    """``rewritten`` with a copy of its graph whose ``gather_bucket`` for each of ``buckets`` (trainable;
    positions in ``rewritten.buffers``) hands its gradient out unreduced instead of reduce-scattering it.

    See [Note: gradient accumulation without sync] (all trainable buckets) and [Note: the last
    reduce-scatter overlaps the optimizer step] (one). The copy takes, after the bucket shards, one
    ``bucketN_pending`` input per such bucket, in bucket order, passed to its gathers as ``pending=``.
    """
    gm = copy_dynamo_graph(rewritten.gm)
    shards = _shard_inputs(gm, rewritten)
    after = shards[-1]
    for i in sorted(buckets):
        after = _add_bucket_input(gm.graph, after, _gathers_of(shards[i]), f"bucket{i}_pending", "pending")
    return _replaced(rewritten, gm)


def take_prefetched(rewritten: Rewritten, buckets: Collection[int]) -> Rewritten:
    """``rewritten`` with a copy of its graph whose ``gather_bucket`` for each of ``buckets`` (positions in
    ``rewritten.buffers``) takes the buffer handed over for it instead of gathering ([Note: the next
    step's first gather starts at the optimizer step]): ``gathered=`` the bucket's position, the slot
    :func:`~fsdp_pass.buckets.gather.hand_over` fills."""
    gm = copy_dynamo_graph(rewritten.gm)
    shards = _shard_inputs(gm, rewritten)
    for i in buckets:
        for gather in _gathers_of(shards[i]):
            gather.kwargs = {**gather.kwargs, "gathered": i}
    return _replaced(rewritten, gm)


def _shard_inputs(gm: fx.GraphModule, rewritten: Rewritten) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="placeholder"))[: len(rewritten.buffers)]


def _replaced(rewritten: Rewritten, gm: fx.GraphModule) -> Rewritten:
    gm.graph.lint()
    gm.recompile()
    return replace(rewritten, gm=gm)


def _gathers_of(shard: fx.Node) -> list[fx.Node]:
    return [u for u in shard.users if u.op == "call_function" and u.target is gather_bucket]


def _add_bucket_input(graph: fx.Graph, after: fx.Node, gathers: list[fx.Node], name: str, keyword: str) -> fx.Node:
    """A new placeholder ``name`` right after ``after``, passed to every one of ``gathers`` as ``keyword=``."""
    with graph.inserting_after(after):
        node = graph.placeholder(name)
    node._dynamo_source = None
    node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    for gather in gathers:
        gather.kwargs = {**gather.kwargs, keyword: node}
    return node
