"""Which ranks a bucket is sharded over (and, for HSDP, replicated over)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ShardingMesh", "resolve_mesh"]


@dataclass(frozen=True)
class ShardingMesh:
    """A DeviceMesh (or None for one process) plus the mesh dim parameters are sharded over.

    On a 1-D mesh every rank shards. On a 2-D mesh ``(replicate, shard)`` (HSDP) parameters are
    sharded over ``shard_dim`` and replicated over the other dim: gradients reduce-scatter over the
    shard dim, then all-reduce over the replicate dim.
    """

    mesh: DeviceMesh | None
    shard_dim: int = 0

    @property
    def shard_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size(self.shard_dim)

    @property
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

    def group_name(self, dim: int) -> str:
        return self.mesh.get_group(dim).group_name

    @property
    def device_type(self) -> str:
        return "cpu" if self.mesh is None else self.mesh.device_type


def resolve_mesh(
    mesh: DeviceMesh | None, shard_dim: int | None = None, argument: str = "options['mesh']"
) -> ShardingMesh:
    """Validate the user's mesh, defaulting to all ranks of the default process group.

    ``mesh=None`` means every rank of the default group (one process without a group).
    A 2-D mesh is read as ``(replicate, shard)`` unless ``shard_dim`` says otherwise.
    ``argument`` is how error messages name the mesh (the backend option, or ``fully_shard``'s argument).
    """
    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            return ShardingMesh(None, 0)
        backend = dist.get_backend()
        device = "cuda" if backend == "nccl" else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{argument} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"{argument} has {mesh.ndim} dims {tuple(mesh.shape)}; give a 1-D mesh (FSDP) or a 2-D "
            f"(replicate, shard) mesh (HSDP)"
        )
    if shard_dim is None:
        shard_dim = mesh.ndim - 1
    if not 0 <= shard_dim < mesh.ndim:
        raise ValueError(f"shard_dim={shard_dim} is not a dim of the {mesh.ndim}-D mesh {tuple(mesh.shape)}")
    if dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise ValueError(
            f"{argument} covers {mesh.size()} ranks but the default process group has "
            f"{dist.get_world_size()}; build the mesh over all ranks (init_device_mesh(device, shape) with "
            f"prod(shape) == world size)"
        )
    return ShardingMesh(mesh, shard_dim)
