"""A bucket's all-gather and reduce-scatter in two levels when its ranks span several nodes.

[Note: collectives in two levels across nodes]
A ring all-gather over the m ranks of N nodes (L ranks each, numbered node by node) crosses between
nodes on N of its m edges, and every piece travels along every edge: ``N·(m-1)`` pieces cross per
all-gather, where ``N·(N-1)·L`` suffice (each of a node's pieces entering every other node once).
On 2 nodes of 2 ranks that is 6 pieces against 4; a reduce-scatter is the same in reverse (gloo's,
an all-reduce of the whole input, sends 12). So when the launcher reports the nodes ([Note: node-local
groups follow the launcher's nodes]) and the shard dim spans N > 1 of them with L > 1 consecutive
ranks on each, a bucket's collectives take two steps (MiCS's hierarchical all-gather, ZeRO++'s
hierarchical reduction):

* all-gather: first *across* nodes, among the N ranks with the same place ``l`` on their nodes (the
  only step that uses the slow links: ``N-1`` pieces per rank), then *within* the node, among its L
  ranks, each sending the N pieces it holds. The result arrives grouped by place on the node, ``(l, n)``;
  the bucket's layout is rank order ``(n, l)``, so one copy puts it there. That copy is the only one:
  parameters are views of the output, as in one step.
* reduce-scatter: the input is copied into ``(l, n)`` order, reduce-scattered *within* the node
  (each rank gets the node's sum for the N pieces of its place), then *across* nodes among the N
  ranks of its place, which leaves each rank its own piece. Sums are taken in another order than
  one ring's, so results agree with the one-step reduction to rounding, not bitwise.
* with ``quantized_reduce`` ([Note: block-quantized gradient reduction]) the within-node step stays
  in ``reduce_dtype`` and only the across-node step moves int8 codes: the node's partial sums are
  quantized once, half the rows of the one-step form cross, and fewer roundings enter each sum.

Both steps are functional collectives over two ordinary process groups (the N ranks of a place, the
L ranks of a node), made by every rank of the world ([Note: every rank makes every group] in
buckets/launcher_nodes.py), and written into the graphs as they are: the all-gather is
``all_gather(across) ─ wait ─ all_gather(within) ─ wait ─ in_rank_order``, the reduce-scatter
``copy into (l, n) ─ reduce_scatter(within) ─ wait ─ reduce_scatter(across) ─ wait``. The overlap
schedule issues the across-node gather (the slow step) ahead like a one-step gather, and a bucket's
two reduce-scatters are one reduction to it (compile/passes/schedule.py). A bucket's
:class:`~fsdp_pass.buckets.gather.GatherConfig` carries its :class:`NodeLevels`; every other
collective (HSDP's all-reduce, agreements) runs on the one-step shard group. No process group or
backend of fsdp_pass's own is registered with torch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from .launcher_nodes import WorldRows, groups_made_everywhere, launcher_reports_nodes, world_rows

__all__ = ["NodeLevels", "all_gather_in_two_levels", "finish_gather_within_node", "make_node_levels",
           "reduce_scatter_in_two_levels", "within_node_sums"]

_c10d = torch.ops._c10d_functional


class NodeLevels(NamedTuple):
    """How one shard group's ranks lie on nodes, and the groups of the two steps (by name: a graph constant)."""

    nodes: int  # N: nodes the shard group spans
    per_node: int  # L: its ranks on each node, consecutive
    across: str  # name of this rank's group of the N ranks with its place on their nodes
    within: str  # name of this rank's group of the L ranks of its node


@torch.library.custom_op("fsdp_pass::in_rank_order", mutates_args=())
def in_rank_order(spread: torch.Tensor, nodes: int, per_node: int) -> torch.Tensor:
    """A two-level all-gather's output, grouped by place on the node ``(l, n)``, copied into the bucket's
    rank order ``(n, l)``. An op of its own so that the gather chain is easy to recognise (and a copy
    Inductor keeps)."""
    piece = spread.numel() // (nodes * per_node)
    return spread.view(per_node, nodes, piece).transpose(0, 1).contiguous().view(-1)


@in_rank_order.register_fake
def _(spread, nodes, per_node):
    return torch.empty_like(spread)


def finish_gather_within_node(by_place: torch.Tensor, levels: NodeLevels) -> torch.Tensor:
    """Step two of a two-level all-gather: the N pieces of this rank's place (gathered across nodes) →
    the whole bucket in rank order, gathered within the node."""
    spread = _c10d.wait_tensor(_c10d.all_gather_into_tensor(by_place, levels.per_node, levels.within))
    return in_rank_order(spread, levels.nodes, levels.per_node)


def all_gather_in_two_levels(shard: torch.Tensor, levels: NodeLevels) -> torch.Tensor:
    """A bucket's all-gather across the nodes, then within ([Note: collectives in two levels across nodes])."""
    by_place = _c10d.wait_tensor(_c10d.all_gather_into_tensor(shard.contiguous(), levels.nodes, levels.across))
    return finish_gather_within_node(by_place, levels)


def within_node_sums(grad: torch.Tensor, levels: NodeLevels) -> torch.Tensor:
    """Step one of a two-level reduce-scatter: a bucket's whole gradient (``(n, l)`` rank order, N·L
    pieces) → the node's sums of the N pieces of this rank's place, reduce-scattered within the node
    after one copy into ``(l, n)`` order. Graph ops (the quantized form traces it)."""
    n, per_node = levels.nodes, levels.per_node
    piece = grad.numel() // (n * per_node)
    by_place = grad.reshape(n, per_node, piece).transpose(0, 1).contiguous().view(-1)
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(by_place, "sum", per_node, levels.within))


def reduce_scatter_in_two_levels(grad: torch.Tensor, levels: NodeLevels) -> torch.Tensor:
    """A bucket's reduce-scatter within the nodes, then across ([Note: collectives in two levels across nodes])."""
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(within_node_sums(grad, levels), "sum", levels.nodes,
                                                         levels.across))


def make_node_levels(mesh: DeviceMesh, shard_dim: int) -> NodeLevels | None:
    """The :class:`NodeLevels` of this rank's shard group over ``mesh``'s ``shard_dim``, or None when the
    launcher reports no nodes, or the group lies on one node, has one rank per node, or its nodes do not
    hold equal runs of consecutive ranks. Collective over the world: every rank makes the groups of every
    shard row ([Note: every rank makes every group] in buckets/launcher_nodes.py)."""
    if not launcher_reports_nodes():
        return None  # alike on every rank: the launcher sets its variables on all its processes
    shard_group = mesh.get_group(shard_dim)
    world = world_rows(shard_group)
    two_level = {row: layout for row in world.rows
                 if (layout := _layout(row, world)) is not None and layout[0] > 1 and layout[1] > 1}
    if not two_level:
        return None
    # every row's groups, on every rank, in one order (the rows and nodes every rank reported)
    within = [list(row[k * per_node:(k + 1) * per_node]) for row, (n, per_node) in two_level.items() for k in range(n)]
    across = [[row[k * per_node + place] for k in range(n)] for row, (n, per_node) in two_level.items()
              for place in range(per_node)]
    within_group = groups_made_everywhere(within, shard_group, mesh.device_type)
    across_group = groups_made_everywhere(across, shard_group, mesh.device_type)
    if world.mine not in two_level:
        return None
    n, per_node = two_level[world.mine]
    return NodeLevels(n, per_node, across_group.group_name, within_group.group_name)


def _layout(row: tuple[int, ...], world: WorldRows) -> tuple[int, int] | None:
    """(N nodes, L ranks each) when the ranks of ``row`` lie on N nodes in equal runs, one per node."""
    if world.node_of is None:
        return None
    runs: list[tuple[int, int]] = []  # (node, positions in its run)
    for rank in row:
        node = world.node_of[rank]
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + 1)
        else:
            runs.append((node, 1))
    if len({node for node, _ in runs}) != len(runs) or len({size for _, size in runs}) != 1:
        return None
    return len(runs), runs[0][1]
