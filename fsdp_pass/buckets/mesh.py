"""The ranks one bucket is sharded over (and, for HSDP, replicated over): what its collectives use.

Which mesh a parameter gets (roles of a named mesh's dims, the TP/EP rules) is setup-time policy
and lives in :mod:`fsdp_pass.sharding.mesh_roles`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .launcher_nodes import check_groups_within_nodes, groups_made_everywhere, world_rows
from .node_collectives import NodeLevels, make_node_levels

__all__ = ["NodeGroup", "ShardingMesh", "check_mesh_is_current", "check_reshard_group_size"]


@dataclass(frozen=True)
class ShardingMesh:
    """A DeviceMesh (or None for one process) plus the mesh dim parameters are sharded over.

    On a 1-D mesh every rank shards. On a 2-D mesh ``(replicate, shard)`` (HSDP) parameters are
    sharded over ``shard_dim`` and replicated over the other dim: gradients reduce-scatter over the
    shard dim, then all-reduce over the replicate dim.
    """

    mesh: DeviceMesh | None
    shard_dim: int = 0
    grad_divisor: int | None = None  # see ``divisor``
    copies: int = 1  # ranks of the bucket whose gradients are copies of one another's (see ``divisor``)
    two_levels: bool = True  # whether collectives may run in two levels when the shard dim spans nodes

    @property
    def divisor(self) -> int:
        """Gradients are summed over the bucket's ranks and divided by this: the data-parallel degree.

        Default: every rank of the bucket holds a different part of the batch. Under tensor
        parallelism a parameter replicated over the TP ranks is sharded over them too, but their
        gradients are copies, so the divisor counts them once more
        (:meth:`~fsdp_pass.sharding.mesh_roles.ParallelMesh.for_parameter`). That count is ``copies``:
        a gradient divide factor set by the user counts the data-parallel ranks only and is multiplied by it.
        """
        return self.grad_divisor or self.shard_size * self.replicate_size

    def for_parameter(self, name: str, p: torch.Tensor) -> "ShardingMesh":
        """The mesh parameter ``name`` is sharded over: this one, for plain parameters."""
        if isinstance(p, DTensor):
            raise ValueError(
                f"parameter {name!r} is a DTensor on mesh {p.device_mesh} with placements {p.placements}; "
                f"pass the whole mesh with named dims as options['mesh'] (fully_shard's mesh) and name the "
                f"FSDP dim(s) with shard_dim, e.g. init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp')) "
                f"and shard_dim='dp'"
            )
        return self

    @property
    def shard_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size(self.shard_dim)

    @cached_property  # read for every piece of every eager op and gradient; a mesh's ranks never change
    def shard_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank(self.shard_dim)

    @property
    def replicate_dim(self) -> int | None:
        if self.mesh is None or self.mesh.ndim == 1:
            return None
        return 1 - self.shard_dim

    @property
    def replicate_size(self) -> int:
        dim = self.replicate_dim
        return 1 if dim is None else self.mesh.size(dim)

    def data_parallel_groups(self) -> list:
        """The process groups a bucket's gradients are summed over: its shard dim, then its HSDP replicas."""
        groups = []
        if self.shard_size > 1:
            groups.append(self.mesh.get_group(self.shard_dim))
        if self.replicate_dim is not None and self.replicate_size > 1:
            groups.append(self.mesh.get_group(self.replicate_dim))
        return groups

    def group_name(self, dim: int) -> str:
        return self.mesh.get_group(dim).group_name

    def node_levels(self) -> NodeLevels | None:
        """The two levels a bucket's all-gather and reduce-scatter run in when the launcher reports that its
        shard group spans nodes ([Note: collectives in two levels across nodes] in
        buckets/node_collectives.py); None when they run in one step on the shard dim's group. Made on first
        use, once per (mesh, shard dim), by every rank of the world alike ([Note: every rank makes every
        group] in buckets/launcher_nodes.py: a bucket asks when it is made, and the ranks make their buckets
        in one order). None too when ``two_levels`` is off (options['two_level_collectives'])."""
        if self.shard_size == 1 or not self.two_levels:
            return None
        key = (self.mesh, self.shard_dim)
        if key not in _node_levels:
            _node_levels[key] = make_node_levels(self.mesh, self.shard_dim)
        return _node_levels[key]

    @property
    def device_type(self) -> str:
        return "cpu" if self.mesh is None else self.mesh.device_type

    def node_group(self, size: int) -> "NodeGroup":
        """This rank's group of ``size`` consecutive ranks of the shard dim ([Note: reshard within a
        node after forward] in compile/passes/reshard_within_groups.py). The process groups are made once
        per (mesh, shard dim, size), by every rank of the world alike ([Note: every rank makes every group]
        in buckets/launcher_nodes.py)."""
        check_reshard_group_size(size, self.shard_size, "reshard_after_forward")
        key = (self.mesh, self.shard_dim, size)
        if key not in _node_groups:
            _node_groups[key] = _make_node_groups(self.mesh, self.shard_dim, size)
        return _node_groups[key]


class NodeGroup(NamedTuple):
    """This rank's group of consecutive shard-dim ranks that backward gathers within (a node)."""

    size: int  # ranks in the group (k)
    index: int  # this rank's position in it: it keeps piece ``index`` of k of each gathered bucket
    group_name: str  # the process group's name, for functional collectives


# (mesh, shard dim, group size) -> this rank's NodeGroup: process groups are made once and live for the run
_node_groups: dict[tuple, NodeGroup] = {}
# (mesh, shard dim) -> this rank's two levels, or None (ShardingMesh.node_levels)
_node_levels: dict[tuple, NodeLevels | None] = {}


def check_reshard_group_size(size, shard_size: int, argument: str) -> None:
    """Raise unless ``size`` is a group size the shard dim can be cut into: 1 < size < shard_size, dividing it."""
    if isinstance(size, bool) or not isinstance(size, int) or not (1 < size < shard_size) or shard_size % size:
        valid = [k for k in range(2, shard_size) if shard_size % k == 0]
        raise ValueError(
            f"{argument}={size!r} does not cut the shard dim of {shard_size} ranks into groups: use True (reshard "
            f"over all {shard_size} ranks), False (keep parameters gathered) or a group size k with 1 < k < "
            f"{shard_size} that divides {shard_size}" + (f": one of {valid}" if valid else
                                                         f" (there is none for {shard_size} ranks)")
        )


def _make_node_groups(mesh: DeviceMesh, shard_dim: int, size: int) -> NodeGroup:
    """Every shard-dim row of ``mesh`` in the world cut into groups of ``size`` consecutive ranks; this
    rank's group. Collective over the world ([Note: every rank makes every group] in buckets/launcher_nodes.py)."""
    shard_group = mesh.get_group(shard_dim)
    world = world_rows(shard_group)
    groups = [list(row[start:start + size]) for row in world.rows for start in range(0, len(row), size)]
    # [Note: node-local groups follow the launcher's nodes]
    check_groups_within_nodes(groups, "reshard_after_forward", world)
    mine = groups_made_everywhere(groups, shard_group, mesh.device_type)
    return NodeGroup(size, dist.get_process_group_ranks(mine).index(dist.get_rank()), mine.group_name)


def check_mesh_is_current(buf) -> None:
    """Raise if ``buf`` was sharded without a process group but one with several ranks exists now
    ([Note: wrappers around a sharded model] in interop/wrapper_check.py)."""
    if buf.mesh.mesh is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"parameter {buf.names[0]!r} was sharded over a single process (no process group existed when "
            f"fully_shard ran), but this run has {dist.get_world_size()} ranks: the ranks would train without "
            f"gradient sync. Call torch.distributed.init_process_group (or create the framework's Accelerator / "
            f"TrainingArguments) before fully_shard, or leave sharding to torch.compile(model, backend='vescale'), "
            f"which shards at the first call (see docs/integrations.md)"
        )
