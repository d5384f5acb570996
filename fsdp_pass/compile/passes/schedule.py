"""Pass 4: reshard after forward (joint graph) and overlap scheduling (forward and backward graphs).

Reshard: without tags the partitioner saves views of every gathered bucket for backward, which keeps
all unsharded parameters alive until backward (ZeRO-2 memory). Tagging the gather chains
``MUST_RECOMPUTE`` makes the forward save only the shards; backward gathers again.

Overlap: in each forward/backward graph, the first ``prefetch`` all_gathers are issued before any
compute, and every later one ``prefetch`` buckets ahead (before the wait of the bucket ``prefetch``
places earlier, so it runs while that bucket computes), unless the gathered buffers in flight would
exceed ``max_inflight_bytes``; every reduce_scatter stays right
after its bucket's last gradient and its wait sinks to just before the next bucket's
reduce_scatter, so it overlaps that bucket's backward compute (with ``quantized_reduce``, the wait of
the quantized rows' all_to_all, which crosses between nodes). The functional
collectives run asynchronously until their ``wait_tensor``: the graph order is the schedule. On CPU
(gloo) one collective at a time is in flight: each wait moves up to before the next collective
([Note: one collective in flight on gloo]).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ...buckets.gather import GatherConfig, fp8_pack_shard, fp8_unpack, take_gathered
from ...buckets.node_collectives import in_rank_order
from ...buckets.quantized_reduce import quantize_for_reduce

__all__ = ["GATHER_CHAIN_OPS", "GATHER_VIEW_OPS", "gather_chains", "gather_taken_again", "schedule_overlap", "tag_reshard_after_forward"]

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

# The views between a gathered bucket and the parameter views that compute reads.
GATHER_VIEW_OPS = {
    _aten.split_with_sizes.default,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.t.default,
    _aten.permute.default,
    _aten.transpose.int,
    _aten.expand.default,
    _aten.alias.default,
    _aten.slice.Tensor,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
}
# Ops between an all_gather and the parameter views that compute reads: recomputing them is cheap.
GATHER_CHAIN_OPS = GATHER_VIEW_OPS | {
    _c10d.wait_tensor.default,
    fp8_unpack._opoverload,  # [Note: FP8 all-gather]: dequantized after the gather, recomputed with it
    # [Note: collectives in two levels across nodes]: the within-node step after the across-node gather
    # (always reads that gather's wait), then the copy into rank order
    _c10d.all_gather_into_tensor.default,
    in_rank_order._opoverload,
}
# What turns a shard into the all-gather's input: a cast, or the FP8 quantize-and-pack ([Note: FP8 all-gather]).
_CASTS = {_aten._to_copy.default, torch.ops.prims.convert_element_type.default, fp8_pack_shard._opoverload}
_RECOMPUTE_GRAPH_ID = 1_000_003  # any id distinct from user activation-checkpoint regions
_TAKE_GATHERED = take_gathered._opoverload  # a bucket gathered before the graph ran, taken in place of its gather
_QUANTIZE = quantize_for_reduce._opoverload  # a bucket's gradient quantized for its reduction
# Ops whose output holds their one input's values (a view, or a copy in another layout).
_SAME_VALUES = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.clone.default,
                _aten.alias.default}


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target.__name__ == "getitem"


# [Note: the last bucket stays gathered into backward]
# Backward needs first the bucket forward gathered last (the output layer of a whole model): resharding
# it at the end of forward only to gather it again at the start of backward costs an all-gather that
# nothing can hide (backward's first). So a graph that gathers several buckets keeps its last one for
# backward, as FSDP2 never reshards its root module. The cost is that bucket held through the turn from
# forward to backward, where memory peaks: less than the bucket, since it is gathered at the end of the
# forward either way (benchmark llama: +2.9 MB peak tensor memory, 3%, for a 4 MiB output bucket;
# docs/benchmarks.md). ``reshard_last_bucket`` turns it off. A graph of one bucket (a block compiled on
# its own) reshards it: keeping every block's bucket would hold the whole model gathered.


def _is_within_node_step(node: fx.Node) -> bool:
    """An all_gather of a gathered buffer: the second step of a two-level gather ([Note: collectives in two
    levels across nodes]), part of its bucket's chain, not a head."""
    source = node.args[0]
    return isinstance(source, fx.Node) and source.target is _c10d.wait_tensor.default


def _bucket_gathers(graph: fx.Graph) -> list[fx.Node]:
    """Each bucket's (first) all_gather, in graph order."""
    return [n for n in graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)
            if not _is_within_node_step(n)]


def _gather_heads(gm: fx.GraphModule) -> list[fx.Node]:
    """The forward all_gathers and the buffers taken in place of one, in graph order."""
    heads = set(_bucket_gathers(gm.graph)) | set(gm.graph.find_nodes(op="call_function", target=_TAKE_GATHERED))
    return [n for n in gm.graph.nodes if n in heads]


def _chain(head: fx.Node) -> list[fx.Node]:
    """``head``, the cast feeding it and the views computed from it."""
    chain, stack = [head], [head]
    source = head.args[0]
    if head.target is not _TAKE_GATHERED and isinstance(source, fx.Node) and source.target in _CASTS:
        chain.append(source)
    while stack:
        for user in stack.pop().users:
            if user.target in GATHER_CHAIN_OPS or _is_getitem(user):
                chain.append(user)
                stack.append(user)
    return chain


def _shard_of(head: fx.Node) -> fx.Node:
    """The shard placeholder a gather head reads (through its cast or FP8 pack)."""
    source = head.args[0]
    while source.op != "placeholder":
        source = source.args[0]
    return source


def gather_chains(gm: fx.GraphModule) -> set[fx.Node]:
    """Every node of every gather chain of ``gm`` (what recomputing a gather recomputes)."""
    return {n for head in _gather_heads(gm) for n in _chain(head)}


def tag_reshard_after_forward(gm: fx.GraphModule, joint_inputs=None, keep_last: bool = True,
                              kept: frozenset[int] = frozenset()) -> fx.GraphModule:
    """Mark the forward all_gathers (and the buffers taken in place of one, [Note: the next step's
    first gather starts at the optimizer step]), the cast feeding each and its view chain
    MUST_RECOMPUTE; with ``keep_last``, all but the last one of a graph of several ([Note: the last
    bucket stays gathered into backward]); none of the buckets at positions ``kept`` (the graph's first
    placeholders are its buckets' shards, in order)."""
    gathers = _gather_heads(gm)
    shards = list(gm.graph.find_nodes(op="placeholder"))
    for node in gathers[:-1] if keep_last and len(gathers) > 1 else gathers:
        if kept and shards.index(_shard_of(node)) in kept:
            continue
        for n in _chain(node):
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = _RECOMPUTE_GRAPH_ID
    return gm


def gather_taken_again(gm: fx.GraphModule, configs: dict[int, GatherConfig]) -> fx.GraphModule:
    """In a backward graph: replace each buffer taken in place of a gather (recomputed there, since
    :func:`tag_reshard_after_forward` tags it like a gather) by the gather itself, the cast (or FP8
    pack), all_gather, wait (and FP8 unpack) of its bucket's ``configs[slot]``. Backward gathers the
    bucket again, as it would without the prefetch ([Note: the next step's first gather starts at the
    optimizer step]), and the overlap schedule then sees an all_gather it can issue early."""
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_function", target=_TAKE_GATHERED)):
        shard, slot = node.args[0], node.args[1]
        config = configs[slot]
        fake_mode = node.meta["val"].fake_mode
        with graph.inserting_before(node):
            if config.fp8 is not None:
                fp8 = config.fp8
                source = _add(graph, fake_mode, fp8_pack_shard._opoverload, shard, fp8.tile, fp8.scale_slots,
                              fp8.pack_arguments())
            elif shard.meta["val"].dtype != config.param_dtype:
                source = _add(graph, fake_mode, torch.ops.prims.convert_element_type.default, shard, config.param_dtype)
            else:
                source = shard
            levels = config.levels  # [Note: collectives in two levels across nodes]
            gathered = _add(graph, fake_mode, _c10d.all_gather_into_tensor.default, source,
                            *((levels.nodes, levels.across) if levels else (config.shard_world, config.shard_group)))
            gathered = _add(graph, fake_mode, _c10d.wait_tensor.default, gathered)
            if levels is not None:
                gathered = _add(graph, fake_mode, _c10d.all_gather_into_tensor.default, gathered, levels.per_node,
                                levels.within)
                gathered = _add(graph, fake_mode, _c10d.wait_tensor.default, gathered)
                gathered = _add(graph, fake_mode, in_rank_order._opoverload, gathered, levels.nodes, levels.per_node)
            if config.fp8 is not None:
                gathered = _add(graph, fake_mode, fp8_unpack._opoverload, gathered, config.shard_world,
                                shard.meta["val"].numel(), fp8.tile, fp8.scale_slots, fp8.unpack_arguments(),
                                config.param_dtype)
        node.replace_all_uses_with(gathered)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _add(graph: fx.Graph, fake_mode, target, *args) -> fx.Node:
    """A call of ``target`` at the graph's insertion point, with its fake value in ``meta["val"]``."""
    node = graph.call_function(target, args)
    values = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    with fake_mode:
        node.meta["val"] = target(*values)
    return node


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _wait_of(node: fx.Node) -> fx.Node | None:
    return next((u for u in node.users if u.target is _c10d.wait_tensor.default), None)


def _inputs_to_move(node: fx.Node) -> list[fx.Node]:
    """The cast feeding an all_gather, if any: it moves with it (shards are graph inputs)."""
    source = node.args[0]
    if isinstance(source, fx.Node) and source.op != "placeholder":
        if all(isinstance(a, fx.Node) and a.op == "placeholder" for a in source.all_input_nodes):
            return [source]
        return []  # produced by compute: cannot move earlier than its producer
    return []


def _movable(node: fx.Node) -> list[fx.Node] | None:
    """What moves with an all_gather issued earlier (its cast, then itself); None when its input is
    computed in this graph."""
    deps = _inputs_to_move(node)
    if isinstance(node.args[0], fx.Node) and node.args[0].op != "placeholder" and not deps:
        return None
    return [*deps, node]


def _prefetch_all_gathers(graph: fx.Graph, prefetch: int, max_inflight_bytes: int | None) -> None:
    gathers = _bucket_gathers(graph)
    # The first gathers have no earlier bucket to hide behind: issue them before any compute. In a
    # backward graph the first one (the output layer's weights, gathered again after resharding)
    # otherwise waits behind that layer's weight-gradient matmul, which does not read it.
    anchor = list(graph.find_nodes(op="placeholder"))[-1]
    if max_inflight_bytes is None or sum(_nbytes(g) for g in gathers[:prefetch]) <= max_inflight_bytes:
        for node in gathers[:prefetch]:
            for n in _movable(node) or ():
                anchor.append(n)
                anchor = n
    for k in range(prefetch, len(gathers)):
        node, earlier = gathers[k], gathers[k - prefetch]
        earlier_wait = _wait_of(earlier)
        if earlier_wait is None:
            continue
        in_flight = sum(_nbytes(g) for g in gathers[k - prefetch:k + 1])
        if max_inflight_bytes is not None and in_flight > max_inflight_bytes:
            continue  # prefetching would hold too many gathered buckets at once
        for n in _movable(node) or ():
            earlier_wait.prepend(n)


def _reductions(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """Each bucket's gradient reduction as (its first collective, the one whose wait may sink), in graph
    order: its reduce_scatter, twice; in two levels ([Note: collectives in two levels across nodes]) the
    within-node reduce_scatter, then the across-node one it feeds; with ``quantized_reduce``, the
    all_to_all of the quantized rows ([Note: block-quantized gradient reduction]) is the second, after
    the within-node reduce_scatter that feeds it when the bucket reduces in two levels: the step that
    crosses between nodes is the one to overlap."""
    scatters = list(graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default))
    scatter_of = {_wait_of(rs): rs for rs in scatters}  # each reduce_scatter by its wait
    first_of = {rs: rs for rs in scatters}
    for rs in scatters:
        within = scatter_of.get(_source(rs.args[0]))  # the within-node sums it reduces across the nodes
        if within is not None:
            first_of.pop(within, None)
            first_of[rs] = within
    for a2a in graph.find_nodes(op="call_function", target=_c10d.all_to_all_single.default):
        quantized = _source(a2a.args[0])
        if quantized.target is not _QUANTIZE:
            continue  # an exchange of the model's own (expert parallelism)
        within = scatter_of.get(_source(quantized.args[0]))  # the within-node sums it quantizes (two levels)
        first_of.pop(within, None)
        first_of[a2a] = within or a2a
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(((first, last) for last, first in first_of.items()), key=lambda pair: order[pair[0]])


def _source(node: fx.Node) -> fx.Node:
    """``node``, or what it is a view or copy of: up through ops with one tensor input."""
    while node.op == "call_function" and node.target in _SAME_VALUES and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node


def _sink_reduce_scatter_waits(graph: fx.Graph) -> None:
    """Move each gradient reduction's wait (and what only consumes its result) down to just before the
    next reduction, so it overlaps the next bucket's backward compute while at most two gradient
    buckets are in flight."""
    (output,) = graph.find_nodes(op="output")
    reductions = _reductions(graph)
    for (_, rs), next_rs in zip(reductions, [*(first for first, _ in reductions[1:]), output]):
        wait = _wait_of(rs)
        if wait is None:
            continue
        chain, frontier = [wait], [wait]
        while frontier:  # what consumes the reduced shard before it leaves the graph (average, cast, all_reduce)
            for user in frontier.pop().users:
                if user is not output and user not in chain:
                    chain.append(user)
                    frontier.append(user)
        order = {n: i for i, n in enumerate(graph.nodes)}
        if any(inp not in chain and order[inp] > order[wait] for n in chain for inp in n.all_input_nodes):
            continue  # the chain needs something computed later: leave it where autograd put it
        if any(order[n] > order[next_rs] for n in chain):
            continue  # already later than the target
        for n in sorted(chain, key=order.__getitem__):
            next_rs.prepend(n)


# [Note: one collective in flight on gloo]
# On gloo (torch 2.13, CPU build) functional collectives in flight together corrupt the process heap
# (a rank dies with ``malloc(): unaligned tcache chunk detected`` or SIGSEGV). A compiled 4-layer
# llama (aot_eager, 2 ranks, 400-1000 steps a run) crashed in 3 of 5 runs with the overlap schedule,
# and in 3 of 11 with its all-gathers one at a time but a reduce-scatter in flight beside an
# all-gather in backward; with the all-gather prefetch or the reduce-scatter's late wait left out,
# 0 of 8. A loop of functional all-gathers that issues the next before waiting for the last crashes
# within seconds, while the same loop through the ``Work`` API ran clean (docs/reliability.md has
# the script and the table). So on CPU tensors, after the overlap schedule, each wait moves up to
# just before the next collective is issued: one collective is in flight at a time, and it still
# runs during the compute up to that point. With one core per rank, transfers take turns with
# compute anyway: the same llama's steps took as long with either overlap left out. GPU collectives
# (NCCL) keep the schedule as written.


def _is_collective(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "_c10d_functional" and target is not _c10d.wait_tensor.default)


def _on_cpu(collectives: list[fx.Node]) -> bool:
    return any(isinstance(v := n.args[0].meta.get("val"), torch.Tensor) and v.device.type == "cpu"
               for n in collectives if n.args and isinstance(n.args[0], fx.Node))


def _one_collective_in_flight(graph: fx.Graph) -> None:
    """Move each collective's wait up to before the next collective, if it is later ([Note: one
    collective in flight on gloo]). A wait reads only its collective, so it can always move up."""
    in_flight = None  # the collective issued last, while its wait is still ahead
    for node in list(graph.nodes):
        if _is_collective(node):
            wait = _wait_of(in_flight) if in_flight is not None else None
            if wait is not None:
                node.prepend(wait)
            in_flight = node
        elif node.target is _c10d.wait_tensor.default and node.args[0] is in_flight:
            in_flight = None


def schedule_overlap(gm: fx.GraphModule, prefetch: int = 1, max_inflight_bytes: int | None = None) -> fx.GraphModule:
    """Reorder ``gm`` (a forward or backward graph) for communication/compute overlap. ``prefetch=0``
    keeps autograd's order, except that on CPU each wait still moves up to before the next collective."""
    if prefetch > 0:
        _prefetch_all_gathers(gm.graph, prefetch, max_inflight_bytes)
        _sink_reduce_scatter_waits(gm.graph)
    if _on_cpu([n for n in gm.graph.nodes if _is_collective(n)]):
        _one_collective_in_flight(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm
