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

Graphs see one ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` per bucket as before: the two
steps live in a process group of their own (:class:`TwoLevelGroup`, a Python ``ProcessGroup`` made by
``new_group`` through torch's backend registry), whose name the bucket's :class:`GatherConfig` carries.
Its all-gather returns as soon as the across-node step is issued, so that step overlaps compute as
a one-step gather does; the within-node step and the copy run when the graph waits for it. Every
step runs on ordinary process groups, with the shard group's timeout. Other collectives on the group
go to the one-step shard group unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .launcher_nodes import new_local_group, node_of_each_rank

__all__ = ["NodeLevels", "TwoLevelGroup", "node_levels", "two_level_group_name", "within_node_sums"]

_c10d = torch.ops._c10d_functional

BACKEND = "fsdp_pass_two_level"  # the name TwoLevelGroup is registered under in torch's backend registry


class NodeLevels(NamedTuple):
    """How one shard group's ranks lie on nodes, and the groups of the two steps."""

    nodes: int  # N: nodes the shard group spans
    per_node: int  # L: its ranks on each node, consecutive
    across: dist.ProcessGroup  # this rank's group of the N ranks with its place on their nodes
    within: dist.ProcessGroup  # this rank's group of the L ranks of its node
    flat: dist.ProcessGroup  # the one-step shard group: every other collective runs there


class _GatherWork(dist.Work):
    """An across-node all-gather in flight; waiting finishes the gather within the node and the copy."""

    def __init__(self, across: dist.Work, finish: Callable[[], None]) -> None:
        super().__init__()
        self._across, self._finish = across, finish  # the first step's Work; the rest of the gather

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._finish is not None:
            self._across.wait() if not timeout else self._across.wait(timeout)
            finish, self._finish = self._finish, None
            finish()
        return True


class _Done(dist.Work):
    """Several Works waited on together (a coalesced call)."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for work in self._works:
            work.wait() if not timeout else work.wait(timeout)
        return True


class TwoLevelGroup(dist.ProcessGroup):
    """A shard group whose all-gather and reduce-scatter run in two steps, across then within nodes
    ([Note: collectives in two levels across nodes]). Ranks are the shard group's."""

    def __init__(self, rank: int, size: int, levels: NodeLevels) -> None:
        super().__init__(rank, size)
        self.levels = levels
        self._name = ""  # set by new_group

    # -- identity (new_group names the group; functional collectives find it by that name) --------
    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802 (the C++ name the binding calls)
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND

    # -- the two-step collectives ------------------------------------------------------------------
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        n, per_node = self.levels.nodes, self.levels.per_node
        piece = input.numel()
        by_place = input.new_empty(n * piece)  # the N pieces of this rank's place, node by node
        across = dist.all_gather_single(by_place, input.contiguous(), group=self.levels.across, async_op=True)

        def finish() -> None:
            spread = input.new_empty(per_node * n * piece)  # (l, n) order
            dist.all_gather_single(spread, by_place, group=self.levels.within)
            output.view(n, per_node, piece).copy_(spread.view(per_node, n, piece).transpose(0, 1))

        return _GatherWork(across, finish)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        if opts is not None and opts.reduceOp != dist.ReduceOp.SUM:
            return self.levels.flat.reduce_scatter_single(output, input, opts)
        return dist.reduce_scatter_single(output, within_node_sums(input, self.levels), group=self.levels.across,
                                          async_op=True)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        return _Done([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        return _Done([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

    # names of the same calls on other torch versions of the supported range
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- everything else: the one-step shard group ---------------------------------------------------
    def _on_flat(name: str):
        def call(self, *args):
            return getattr(self.levels.flat, name)(*args)
        call.__name__ = name
        return call

    allreduce = _on_flat("allreduce")
    allgather = _on_flat("allgather")
    broadcast = _on_flat("broadcast")
    barrier = _on_flat("barrier")
    all_to_all_single = alltoall_base = _on_flat("all_to_all_single")
    reduce_scatter = _on_flat("reduce_scatter")
    del _on_flat


def within_node_sums(grad: torch.Tensor, levels: NodeLevels) -> torch.Tensor:
    """Step one of a two-level reduce-scatter: a bucket's whole gradient (``(n, l)`` rank order, N·L
    pieces) → the node's sums of the N pieces of this rank's place, reduce-scattered within the node
    after one copy into ``(l, n)`` order. Graph ops (the quantized form traces it), waited at once: the
    within-node links are fast."""
    n, per_node = levels.nodes, levels.per_node
    piece = grad.numel() // (n * per_node)
    by_place = grad.reshape(n, per_node, piece).transpose(0, 1).contiguous().view(-1)
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(by_place, "sum", per_node, levels.within.group_name))


def node_levels(group_name: str | None) -> NodeLevels | None:
    """The :class:`NodeLevels` of the group named ``group_name`` when it is a :class:`TwoLevelGroup`."""
    if group_name is None:
        return None
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return group.levels if isinstance(group, TwoLevelGroup) else None


def _create(backend_options: dist.distributed_c10d._DistributedBackendOptions, levels: NodeLevels) -> TwoLevelGroup:
    """torch's backend registry calls this from ``new_group(..., backend=BACKEND, pg_options=levels)``."""
    return TwoLevelGroup(backend_options.group_rank, backend_options.group_size, levels)


def _register_backend() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def two_level_group_name(mesh: DeviceMesh, shard_dim: int) -> str | None:
    """The name of this rank's :class:`TwoLevelGroup` over ``mesh``'s ``shard_dim``, or None when the
    launcher reports no nodes, or this rank's shard group lies on one node, has one rank per node, or its
    nodes do not hold equal runs of consecutive ranks. Collective over that shard group only (its ranks
    make their buckets alike; a pipeline stage's sub-mesh needs no call from the other stages): the
    nodes are exchanged in it and the groups are made with group-local synchronization."""
    shard_group = mesh.get_group(shard_dim)
    nodes = node_of_each_rank(shard_group)
    layout = None if nodes is None else _layout(nodes)
    if layout is None or layout[0] == 1 or layout[1] == 1:
        return None
    n, per_node = layout
    row = dist.get_process_group_ranks(shard_group)
    position = row.index(dist.get_rank())
    node, place = divmod(position, per_node)
    device = mesh.device_type
    across = new_local_group([row[k * per_node + place] for k in range(n)], shard_group, device)
    within = new_local_group(row[node * per_node:(node + 1) * per_node], shard_group, device)
    _register_backend()
    levels = NodeLevels(n, per_node, across, within, shard_group)
    return new_local_group(row, shard_group, device, backend=BACKEND, pg_options=levels).group_name


def _layout(nodes: list[int]) -> tuple[int, int] | None:
    """(N nodes, L ranks each) when ``nodes`` (each position's node) is N equal runs, one per node."""
    runs: list[tuple[int, int]] = []  # (node, positions in its run)
    for node in nodes:
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + 1)
        else:
            runs.append((node, 1))
    if len({node for node, _ in runs}) != len(runs) or len({size for _, size in runs}) != 1:
        return None
    return len(runs), runs[0][1]
