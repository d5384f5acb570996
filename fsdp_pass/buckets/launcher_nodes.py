"""Which node each rank runs on, as the launcher reports it, and the process groups fsdp_pass makes beside a
mesh's own: node-local groups must follow the nodes, and every rank makes every group.

[Note: node-local groups follow the launcher's nodes]
``reshard_after_forward=k`` gathers backward's parameters within groups of k consecutive shard-dim
ranks, meant to be the ranks of one node, whose links are fast. Consecutive ranks are one node only
when the launcher numbers them so: ``torchrun`` gives node ``GROUP_RANK`` the ranks
``[GROUP_RANK · LOCAL_WORLD_SIZE, …)`` when every node runs the same number of processes, but another
launcher, uneven nodes or a mesh built over a permuted rank list break that. So the groups are
checked against where the ranks are: when the launcher set ``GROUP_RANK`` (torchrun, and Slurm's
``SLURM_NODEID`` under srun), every rank reports its node and its shard row, and a group that spans
nodes is refused with the node layout and the fix. Without a launcher's node number (one process, a
local spawn) nothing is known, and the groups stay consecutive ranks.

[Note: every rank makes every group]
NCCL makes a new group by splitting the default group's communicator (``ncclCommSplit`` when the
default group has a bound device): every rank of the default group must take part, in the same order,
non-members included, or the members wait forever. gloo forgives a group made by its members alone,
NCCL does not. So fsdp_pass makes its groups (node groups for ``reshard_after_forward=k``, the two
levels of [Note: collectives in two levels across nodes]) the way ``DeviceMesh`` makes its dims':
every rank of the world learns every shard row of the world (one ``all_gather_object`` over the
default group), and calls ``new_group`` for every group of every row, in one order; torch splits the
communicator once per call and hands non-members no group. They are made once per (mesh, shard dim,
kind) and live for the run. The point where they are made is therefore collective over the world:
the first bucket over the mesh (``fully_shard``, or the first compile when the compile shards). A
pipeline whose stages shard over sub-meshes reaches it together when its stages call ``fully_shard``
at setup, as torchtitan does; stages that are only compiled, and first compile at different times,
need no such groups unless two levels or ``reshard_after_forward=k`` ask for them.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["WorldRows", "check_groups_within_nodes", "groups_made_everywhere", "launcher_reports_nodes", "world_rows"]

_NODE_VARIABLES = ("GROUP_RANK", "SLURM_NODEID")  # the node number torchrun / Slurm's srun give each process


def _my_node() -> int | None:
    for name in _NODE_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return None


def launcher_reports_nodes() -> bool:
    """Whether the launcher gave this process a node number (it gives one to all its processes or none)."""
    return _my_node() is not None


class WorldRows(NamedTuple):
    """What every rank of the world reported about one shard dim: its row and its node."""

    mine: tuple[int, ...]  # this rank's shard row (global ranks, in the group's rank order)
    rows: tuple[tuple[int, ...], ...]  # every distinct shard row of the world, in one order on every rank
    node_of: dict[int, int] | None  # global rank → the node the launcher gave it; None where it gave none


def world_rows(shard_group: dist.ProcessGroup) -> WorldRows:
    """The shard rows of every rank of the world and, where the launcher reports nodes, each rank's node.
    Collective over the default group ([Note: every rank makes every group]); under the fake process
    group (no data moves) only this rank's row is known, and no node."""
    mine = tuple(dist.get_process_group_ranks(shard_group))
    if dist.get_backend() == "fake":
        return WorldRows(mine, (mine,), None)
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (mine, _my_node()))
    rows = tuple(sorted({row for row, _ in reports}))
    nodes = [node for _, node in reports]
    return WorldRows(mine, rows, None if any(n is None for n in nodes) else dict(enumerate(nodes)))


def check_groups_within_nodes(groups: list[list[int]], argument: str, world: WorldRows) -> None:
    """Raise unless each of ``groups`` (global ranks) runs on one node, as far as the launcher says
    ([Note: node-local groups follow the launcher's nodes])."""
    if world.node_of is None:
        return
    node_of = world.node_of
    for members in groups:
        spans = sorted({node_of[r] for r in members})
        if len(spans) > 1:
            local = os.environ.get("LOCAL_WORLD_SIZE", "?")
            row = next(r for r in world.rows if members[0] in r)
            layout = {n: [r for r in row if node_of[r] == n] for n in sorted({node_of[r] for r in row})}
            raise ValueError(
                f"{argument}={len(members)} makes the node-local group of ranks {members}, but the launcher placed "
                f"them on nodes {spans} (ranks by node: {layout}); backward's gathers would cross nodes. Use the "
                f"number of processes per node (LOCAL_WORLD_SIZE={local}) or a divisor of it, and launch with the "
                f"same number of processes on every node so that each node's ranks are consecutive"
            )


def groups_made_everywhere(groups: list[list[int]], beside: dist.ProcessGroup,
                           device_type: str) -> dist.ProcessGroup | None:
    """This rank's group among ``groups`` (disjoint lists of global ranks; None when none holds this rank),
    every one made here: every rank of the world calls this with the same ``groups`` in the same order
    ([Note: every rank makes every group]). Timeout: ``beside``'s, since ``new_group``'s own default is
    30 minutes whatever ``init_process_group`` was given."""
    timeout: timedelta = beside._get_backend(torch.device(device_type)).options._timeout
    if dist.distributed_c10d._get_default_group().bound_device_id is not None and torch.accelerator.is_available():
        # the default communicator is initialised: one split makes them all, as DeviceMesh does (``groups``
        # partition the world: every rank reported its row)
        return dist.split_group(split_ranks=groups, timeout=timeout)
    me, mine = dist.get_rank(), None
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timeout)
        if me in ranks:
            mine = group
    return mine
