"""Pass 4 (joint graph), with ``reshard_after_forward=k``: after forward each rank keeps 1/k of every
gathered bucket, and backward all-gathers the bucket within its group of k ranks.

[Note: reshard within a node after forward]
FSDP2's ``reshard_after_forward=<int>`` and ZeRO++'s hpZ: at scale the links between nodes, not
compute, set the step time, and ZeRO-3 pays a second all-gather over all ranks in backward. With
``k`` (the ranks of a node, e.g. 8), the shard dim's ranks form groups of k consecutive ranks
(``ShardingMesh.node_group``); rank ``j`` of its group keeps piece ``j`` of k of the bucket it
gathered in forward (the bucket's whole ``m·S`` buffer cut into k equal, contiguous pieces), and
backward rebuilds the bucket with one all-gather of k such pieces inside the group. Nothing else
changes: gradients reduce-scatter over the whole shard dim into the same shards, the optimizer state
stays sharded over all m ranks.

In the joint graph, for each gather chain resharded (``head`` ─ cast ─ all_gather ─ wait ─ [FP8
unpack] ─ views, or the buffer taken in place of the gather), where ``full`` is the gathered buffer
in ``param_dtype``:

    full ─ kept_piece(j) = kept                    (MUST_SAVE: the saved tensor, bucket / k)
    kept ─ all_gather(k, group) ─ wait ─ views'    (MUST_RECOMPUTE, must be in backward: backward's
                                                    copies of the views)

and every use of a chain node by a node that depends on a tangent (backward) reads its copy
instead. The piece is copied so that saving it does not keep the whole gathered buffer alive, by an
op of its own: Inductor drops a ``clone`` as a no-op, and the saved slice would then hold the whole
bucket. The re-gather is tagged for backward (the partitioner's ``must_be_in_backward``): it reads
only forward values, so it would otherwise also land in the forward graph, where collectives are never
dead-code eliminated, and run there once more for nothing, waited before the next bucket's gather. For an
FP8 bucket the kept piece is dequantized values: backward gets the same weights forward used,
bitwise, as when it recomputes the FP8 gather, and gathering them within the node costs no
quantization error. ``keep_last`` ([Note: the last bucket stays gathered into backward]) applies as
with ``True``.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ...buckets.dbuffer import DBuffer
from ...buckets.gather import GatherConfig
from ...buckets.mesh import NodeGroup
from .schedule import _RECOMPUTE_GRAPH_ID, _add, _chain, _gather_heads

__all__ = ["GraphReshard", "node_groups", "reshard_setting", "reshard_within_groups"]

_c10d = torch.ops._c10d_functional


def reshard_within_groups(gm: fx.GraphModule, group_of: Callable[[fx.Node], NodeGroup | None],
                          keep_last: bool = True) -> fx.GraphModule:
    """Rewrite each forward gather chain of the joint graph ``gm`` (all but the last one of several with
    ``keep_last``) as in [Note: reshard within a node after forward]. ``group_of(head)`` is the node group
    of the bucket a chain gathers (head: an all_gather or the buffer taken in place of one)."""
    heads = _gather_heads(gm)
    backward = _depends_on_tangents(gm.graph)
    for head in heads[:-1] if keep_last and len(heads) > 1 else heads:
        group = group_of(head)
        if group is None:
            raise RuntimeError(f"no node group for the gather {head.format_node()}")
        _reshard_chain(gm.graph, _chain(head), _gathered_buffer(head), group, backward)
    gm.graph.lint()
    gm.recompile()
    return gm


def _gathered_buffer(head: fx.Node) -> fx.Node:
    """The chain node holding the whole gathered bucket in ``param_dtype``: the wait (or, in two levels,
    the copy into rank order after the within-node step; or the FP8 unpack after either), or the taken
    buffer itself."""
    if head.target is not _c10d.all_gather_into_tensor.default:
        return head
    gathered = _only_user(head, _c10d.wait_tensor.default)
    within = _only_user(gathered, _c10d.all_gather_into_tensor.default)
    if within is not None:  # [Note: collectives in two levels across nodes]
        gathered = _only_user(_only_user(within, _c10d.wait_tensor.default), torch.ops.fsdp_pass.in_rank_order.default)
    return _only_user(gathered, torch.ops.fsdp_pass.fp8_unpack.default) or gathered


def _only_user(node: fx.Node, target) -> fx.Node | None:
    """The user of ``node`` calling ``target`` (at most one), or None."""
    users = [u for u in node.users if u.target is target]
    return users[0] if users else None


def _depends_on_tangents(graph: fx.Graph) -> set[fx.Node]:
    """The joint graph's backward: every node computed from a tangent."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def _reshard_chain(graph: fx.Graph, chain: list[fx.Node], full: fx.Node, group: NodeGroup,
                   backward: set[fx.Node]) -> None:
    fake_mode = full.meta["val"].fake_mode
    numel = full.meta["val"].numel()
    piece = numel // group.size  # the gathered buffer is m·S and k divides m
    in_chain = set(chain)
    below, stack = set(), [full]  # the views of the gathered buffer
    while stack:
        for user in stack.pop().users:
            if user in in_chain and user not in below:
                below.add(user)
                stack.append(user)
    order = {n: i for i, n in enumerate(graph.nodes)}
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(full.next):  # new nodes in creation order, right after ``full``
        kept = _add(graph, fake_mode, torch.ops.fsdp_pass.kept_piece.default, full, group.index * piece, piece)
        gathered = _add(graph, fake_mode, _c10d.all_gather_into_tensor.default, kept, group.size, group.group_name)
        copies[full] = _add(graph, fake_mode, _c10d.wait_tensor.default, gathered)
        for node in sorted(below, key=order.__getitem__):
            copies[node] = graph.node_copy(node, lambda a: copies.get(a, a))
    kept.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    for node in [gathered, *copies.values()]:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = _RECOMPUTE_GRAPH_ID
        node.meta["partitioner_tag"] = "must_be_in_backward"
    for node, copy in copies.items():
        for user in list(node.users):
            if user in backward and user not in in_chain:
                user.replace_input_with(node, copy)


@torch.library.custom_op("fsdp_pass::kept_piece", mutates_args=())
def kept_piece(full: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """A copy of ``full[start:start + numel]``: the piece of a gathered bucket a rank keeps after forward."""
    return full[start:start + numel].clone()


@kept_piece.register_fake
def _(full, start, numel):
    return full.new_empty(numel)


class GraphReshard(NamedTuple):
    """What one compiled graph does after forward."""

    after: bool | int  # True, False, or a node group size k ([Note: reshard within a node after forward])
    # positions (in the graph's buckets) whose gathered buffer stays for backward although the graph reshards
    # the others: fully_shard(reshard_after_forward=False), or the root's under None, in one graph with
    # inner modules that reshard (FSDP2 decides per module)
    kept: frozenset[int] = frozenset()


def reshard_setting(option: bool | int, buffers: Sequence[DBuffer]) -> GraphReshard:
    """What a graph over ``buffers`` does after forward: ``options["reshard_after_forward"]`` when not
    the default True, else the settings ``fully_shard(..., reshard_after_forward=...)`` left on the
    buckets (True when none did): one for all, or True with the buckets set to False kept."""
    if option is not True:
        return GraphReshard(option)
    settings = {buf.reshard_after_forward for buf in buffers}
    if settings == {True, False}:
        return GraphReshard(True, frozenset(i for i, b in enumerate(buffers) if b.reshard_after_forward is False))
    if len(settings) > 1:
        names = {s: next(b.names[0] for b in buffers if b.reshard_after_forward == s) for s in settings}
        raise ValueError(
            f"one compiled graph uses parameters sharded with different reshard_after_forward settings "
            f"({', '.join(f'{n!r}: {s!r}' for s, n in names.items())}); a group size k mixes with no other "
            f"setting in one graph: give them one fully_shard setting, compile them as separate graphs, or pass "
            f"options['reshard_after_forward'] to decide for the graph"
        )
    return GraphReshard(settings.pop() if settings else True)


def node_groups(size: int, buffers: Sequence[DBuffer],
                taken: Mapping[int, GatherConfig] | None) -> Callable[[fx.Node], NodeGroup | None]:
    """``group_of`` for :func:`reshard_within_groups`: each gather's node group of ``size`` ranks, found by
    the group of its (first) all-gather (or, for a buffer taken in place of a gather, its slot's). The
    process groups are made here, before tracing, by every rank alike."""
    by_gather_group = {buf.config(buf.dtype, buf.dtype).gather_group: buf.mesh.node_group(size)
                       for buf in buffers if buf.mesh.shard_size > 1}
    slots = dict(taken or {})

    def group_of(head: fx.Node) -> NodeGroup | None:
        if head.target is _c10d.all_gather_into_tensor.default:
            return by_gather_group.get(head.args[2])
        return by_gather_group.get(slots[head.args[1]].gather_group)

    return group_of
