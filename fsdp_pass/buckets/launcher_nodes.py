"""Which node each rank runs on, as the launcher reports it: what node-local groups must follow.

[Note: node-local groups follow the launcher's nodes]
``reshard_after_forward=k`` gathers backward's parameters within groups of k consecutive shard-dim
ranks, meant to be the ranks of one node, whose links are fast. Consecutive ranks are one node only
when the launcher numbers them so: ``torchrun`` gives node ``GROUP_RANK`` the ranks
``[GROUP_RANK · LOCAL_WORLD_SIZE, …)`` when every node runs the same number of processes, but another
launcher, uneven nodes or a mesh built over a permuted rank list break that. So the groups are
checked against where the ranks are: when the launcher set ``GROUP_RANK`` (torchrun, and Slurm's
``SLURM_NODEID`` under srun), the ranks of the shard group share their node numbers (one small
all-gather in that group when its node groups are made; a launcher sets the variable on all its
processes), and a group that spans nodes is refused with the node layout and the fix. Node groups
are made by their members alone (:func:`new_local_group`), so a pipeline stage sharding over a
sub-mesh needs no call from the other stages. Without a launcher's node number (one process, a local spawn) nothing is known, and the
groups stay consecutive ranks.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["check_groups_within_nodes", "new_local_group", "node_of_each_rank"]

_NODE_VARIABLES = ("GROUP_RANK", "SLURM_NODEID")  # the node number torchrun / Slurm's srun give each process


def _my_node() -> int | None:
    for name in _NODE_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return None


def node_of_each_rank(group: dist.ProcessGroup) -> list[int] | None:
    """The node number the launcher gave each rank of ``group``, in the group's rank order, or None when it
    gave none. Collective over ``group`` when it did (a launcher sets the variables on all its processes
    alike)."""
    mine = _my_node()
    if mine is None or not dist.is_initialized() or dist.get_backend(group) == "fake":  # fake: carries no data
        return None
    nodes: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(nodes, mine, group=group)
    return None if any(n is None for n in nodes) else nodes


def check_groups_within_nodes(groups: list[list[int]], argument: str, group: dist.ProcessGroup) -> None:
    """Raise unless each of ``groups`` (global ranks of ``group``) runs on one node, as far as the launcher
    says ([Note: node-local groups follow the launcher's nodes]). Collective over ``group``: its ranks call
    it alike."""
    nodes = node_of_each_rank(group)
    if nodes is None:
        return
    ranks = dist.get_process_group_ranks(group)
    node_of = dict(zip(ranks, nodes))
    for members in groups:
        spans = sorted({node_of[r] for r in members})
        if len(spans) > 1:
            local = os.environ.get("LOCAL_WORLD_SIZE", "?")
            layout = {n: [r for r in ranks if node_of[r] == n] for n in sorted(set(nodes))}
            raise ValueError(
                f"{argument}={len(members)} makes the node-local group of ranks {members}, but the launcher placed "
                f"them on nodes {spans} (ranks by node: {layout}); backward's gathers would cross nodes. Use the "
                f"number of processes per node (LOCAL_WORLD_SIZE={local}) or a divisor of it, and launch with the "
                f"same number of processes on every node so that each node's ranks are consecutive"
            )


def new_local_group(ranks: list[int], beside: dist.ProcessGroup, device_type: str, **options) -> dist.ProcessGroup:
    """A process group of ``ranks`` made by its members alone (group-local synchronization: ranks outside,
    another pipeline stage's, need not call), with the timeout of ``beside``: ``new_group``'s own default is
    30 minutes whatever ``init_process_group`` was given. ``options``: further ``new_group`` arguments."""
    timeout = beside._get_backend(torch.device(device_type)).options._timeout
    return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True, **options)
