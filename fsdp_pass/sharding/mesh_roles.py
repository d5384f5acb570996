"""Roles of a mesh's dims: which ranks each parameter is sharded over (setup time).

A plain 1-D or 2-D mesh gives one :class:`~fsdp_pass.buckets.mesh.ShardingMesh` for every
parameter. A named mesh that also carries the model's own parallelism (tensor or expert parallel
DTensor parameters) is a :class:`ParallelMesh`: each parameter is sharded over the mesh dims its
DTensor placements do not use (its "FSDP dims"), so the order is "TP/EP first, then FSDP"
(see [Note: FSDP over TP/EP] in :mod:`fsdp_pass.sharding.materialize`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..buckets.mesh import ShardingMesh

__all__ = ["ParallelMesh", "check_rank_in_mesh", "default_device_type", "model_mesh_dims", "resolve_mesh"]


def default_device_type() -> str:
    """The device type of the mesh made when none is given, and of the tensors of collectives over the
    default group: the current accelerator's when one is available (FSDP2's rule), else ``"cpu"``.

    Read from the machine, not from the backend's name: ``init_process_group("nccl")`` has no backend for
    CPU tensors, and ``"cuda:nccl,cpu:gloo"`` or a backend left to torch's choice are CUDA groups too."""
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return accelerator.type
    return "cpu"


def check_rank_in_mesh(mesh: DeviceMesh, argument: str = "options['mesh']") -> None:
    """Refuse a mesh that does not include this rank.

    A mesh over a subset of the world is fine (pipeline stages, one data-parallel group per
    stage): every collective the backend issues runs over that mesh's groups only. But the ranks
    that shard or compile a model must be in its mesh.
    """
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(
            f"{argument} {mesh} over ranks {mesh.mesh.flatten().tolist()} does not include this rank "
            f"({dist.get_rank()}); each rank must pass a mesh it belongs to, e.g. slice it from one mesh over all "
            f"ranks on every rank: init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', 'dp'))['dp']"
        )


def model_mesh_dims(params: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    """Names of the mesh dims the model's own DTensor parameters are placed on (TP, EP), in first-seen order."""
    names: list[str] = []
    for name, p in params:
        if isinstance(p, DTensor):
            dims = p.device_mesh.mesh_dim_names
            if not dims:
                raise ValueError(
                    f"parameter {name!r} is a DTensor on a mesh without dim names ({p.device_mesh}); build the "
                    f"mesh with mesh_dim_names and slice the TP/EP mesh from it (mesh['tp'])"
                )
            names += [d for d in dims if d not in names]
    return tuple(names)


def resolve_mesh(
    mesh: DeviceMesh | None,
    shard_dim: int | str | Sequence[str] | None = None,
    argument: str = "options['mesh']",
    *,
    replicate_dim: int | str | None = None,
    model_dims: Sequence[str] = (),
    two_levels: bool = True,
) -> "ShardingMesh | ParallelMesh":
    """Validate the user's mesh, defaulting to all ranks of the default process group.

    ``mesh=None`` means every rank of the default group (one process without a group).
    A 2-D mesh is read as ``(replicate, shard)`` unless ``shard_dim`` says otherwise.
    ``argument`` is how error messages name the mesh (the backend option, or ``fully_shard``'s argument).
    With ``model_dims`` (the dims of the model's DTensor parameters, :func:`model_mesh_dims`), dims
    given by name, or more than two dims, the result is a :class:`ParallelMesh`. ``two_levels``: whether
    collectives may run in two levels across the launcher's nodes (``two_level_collectives``).
    """
    resolved = _resolve_mesh(mesh, shard_dim, argument, replicate_dim, model_dims)
    return resolved if two_levels else dataclasses.replace(resolved, two_levels=False)


def _resolve_mesh(mesh, shard_dim, argument: str, replicate_dim,
                  model_dims: Sequence[str]) -> "ShardingMesh | ParallelMesh":
    if model_dims or replicate_dim is not None or isinstance(shard_dim, (str, tuple, list)) or (
        isinstance(mesh, DeviceMesh) and mesh.ndim > 2 and mesh.mesh_dim_names  # unnamed: the 1-D/2-D message
    ):
        return ParallelMesh.resolve(mesh, shard_dim, replicate_dim, tuple(model_dims), argument)
    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            return ShardingMesh(None, 0)
        mesh = init_device_mesh(default_device_type(), (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{argument} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"{argument} has {mesh.ndim} dims {tuple(mesh.shape)}; give a 1-D mesh (FSDP) or a 2-D "
            f"(replicate, shard) mesh (HSDP). A mesh with more dims (tensor/expert parallel) needs mesh_dim_names "
            f"and shard_dim naming its data-parallel dim(s)"
        )
    if shard_dim is None:
        shard_dim = mesh.ndim - 1
    if not 0 <= shard_dim < mesh.ndim:
        raise ValueError(
            f"shard_dim={shard_dim} is not a dim of the {mesh.ndim}-D mesh {tuple(mesh.shape)}; pass shard_dim in "
            f"range({mesh.ndim}) (on a 2-D mesh the other dim replicates), or leave it out to shard over the last dim"
        )
    check_rank_in_mesh(mesh, argument)
    return ShardingMesh(mesh, shard_dim)


@dataclass(frozen=True)
class ParallelMesh:
    """A named mesh whose dims have roles: FSDP ``shard_dims``, an HSDP ``replicate_dim``, and the rest.

    The rest are the model's own parallel dims (tensor parallel): the batch is not split over
    them. Expert parallelism splits the batch, so an EP dim is listed in ``shard_dims``: plain
    parameters are sharded over it like any FSDP dim, and experts (DTensors on it) are sharded over
    the remaining FSDP dims.
    """

    root: DeviceMesh
    shard_dims: tuple[str, ...]
    replicate_dim: str | None = None
    two_levels: bool = True  # handed to every ShardingMesh made here

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.root.mesh_dim_names)

    @property
    def device_type(self) -> str:
        return self.root.device_type

    def size(self, name: str) -> int:
        return self.root.size(self.names.index(name))

    def for_parameter(self, name: str, p: torch.Tensor) -> ShardingMesh:
        """Shard over every dim but the replicate dim and the dims ``p``'s own DTensor placements split.

        A DTensor dim placed ``Replicate()`` (a row-parallel bias, a sequence-parallel norm) holds
        the whole tensor on each of its ranks, like a plain parameter: it is sharded over that dim
        too, and its gradient copies (``DTensor.from_local``'s backward makes them whole and equal
        on every TP rank, all-reducing a partial one) are counted once by the divisor.
        """
        own = _split_dims(name, p, self) if isinstance(p, DTensor) else ()
        dims = tuple(n for n in self.names if n != self.replicate_dim and n not in own)
        data_parallel = set(self.shard_dims) | ({self.replicate_dim} if self.replicate_dim else set())
        copies = math.prod(self.size(n) for n in dims if n not in data_parallel)
        divisor = math.prod(self.size(n) for n in data_parallel) * copies
        if not dims:  # nothing left to shard over: a one-rank "shard" group
            return ShardingMesh(None, 0, divisor, copies) if self.replicate_dim is None else ShardingMesh(
                self.root[self.replicate_dim], 0, divisor, copies, self.two_levels)
        shard_name = dims[0] if len(dims) == 1 else "_".join(dims)
        shard_mesh = self.root[shard_name] if len(dims) == 1 else self.root[dims]._flatten(shard_name)
        if self.replicate_dim is None:
            return ShardingMesh(shard_mesh, 0, divisor, copies, self.two_levels)
        return ShardingMesh(self.root[(self.replicate_dim, shard_name)], 1, divisor, copies, self.two_levels)

    @staticmethod
    def resolve(mesh, shard_dim, replicate_dim, model_dims: tuple[str, ...], argument: str) -> "ParallelMesh":
        if mesh is None:
            raise ValueError(
                f"the model has DTensor parameters on mesh dims {list(model_dims)}: pass the whole mesh as {argument} "
                f"(init_device_mesh(device, shape, mesh_dim_names=(...))) and name its FSDP dim(s) with shard_dim"
            )
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{argument} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        if not names:
            raise ValueError(
                f"{argument} {tuple(mesh.shape)} has no dim names; build it with init_device_mesh(device, shape, "
                f"mesh_dim_names=(...)) so FSDP, replicate and TP/EP dims can be told apart"
            )

        def name_of(dim, what: str) -> str:
            if isinstance(dim, int) and 0 <= dim < len(names):
                return names[dim]
            if dim in names:
                return dim
            raise ValueError(f"{what}={dim!r} is not a dim of {argument}, whose dims are {list(names)}")

        rep = None if replicate_dim is None else name_of(replicate_dim, "replicate_dim")
        if shard_dim is None:
            free = [n for n in names if n not in model_dims and n != rep]
            if not free:
                raise ValueError(
                    f"every dim of {argument} {list(names)} is used by DTensor parameters or replication; add a "
                    f"dim for FSDP and name it with shard_dim"
                )
            shard_dim = free[-1]
        shard = (shard_dim,) if isinstance(shard_dim, (str, int)) else tuple(shard_dim)
        shard_dims = tuple(name_of(d, "shard_dim") for d in shard)
        if rep in shard_dims:
            raise ValueError(f"mesh dim {rep!r} cannot be both shard_dim and replicate_dim")
        used = set(shard_dims) | set(model_dims) | ({rep} if rep else set())
        if rep is None and len(names) == 2 and not model_dims:
            rep = next(n for n in names if n not in shard_dims)  # a 2-D mesh without TP/EP: (replicate, shard)
            used.add(rep)
        unused = [n for n in names if n not in used]
        if unused:
            raise ValueError(
                f"mesh dims {unused} of {argument} {list(names)} have no role: they are not shard_dim {list(shard_dims)}, "
                f"not replicate_dim ({rep}) and no DTensor parameter is placed on them; name them in shard_dim "
                f"(data parallel, FSDP) or replicate_dim (HSDP)"
            )
        if rep is not None and rep in model_dims:
            raise ValueError(f"replicate_dim {rep!r} is also a dim of the model's DTensor parameters; pick another dim")
        check_rank_in_mesh(mesh, argument)
        return ParallelMesh(mesh, shard_dims, rep)


def _is_slice_of(part: DeviceMesh, whole: DeviceMesh) -> bool:
    """Whether each dim of ``part`` is a dim of ``whole`` over the same ranks (this rank's group along it).

    A slice of ``whole`` itself is; so is a slice of another mesh unflattened from the same world mesh
    with the same dim (torchtitan slices its TP mesh from its data-loading mesh, not its FSDP mesh).
    """
    if part._get_root_mesh() is whole._get_root_mesh():
        return True
    names = whole.mesh_dim_names or ()
    return all(name in names and part[name].mesh.tolist() == whole[name].mesh.tolist()
               for name in part.mesh_dim_names or ())


def _split_dims(name: str, p: DTensor, mesh: ParallelMesh) -> tuple[str, ...]:
    """Names of the dims ``p``'s placements split (``Shard``); refuses placements FSDP cannot compose with."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not _is_slice_of(p.device_mesh, mesh.root):
        raise ValueError(
            f"parameter {name!r} is a DTensor on {p.device_mesh}, which is not a slice of the mesh the model is "
            f"sharded over ({mesh.root}); slice its TP/EP mesh from that mesh (mesh['tp'])"
        )
    names = tuple(p.device_mesh.mesh_dim_names or ())
    split = []
    for dim, placement in zip(names, p.placements):
        if isinstance(placement, _StridedShard):
            raise ValueError(
                f"parameter {name!r} (shape {tuple(p.shape)}) has DTensor placements {p.placements}: a _StridedShard "
                f"comes from another FSDP (torch's fully_shard) applied over tensor parallelism; give fsdp_pass the "
                f"model with only its TP/EP placements (parallelize_module, no fully_shard) and let it do the "
                f"data-parallel sharding"
            )
        if isinstance(placement, Partial):
            raise ValueError(
                f"parameter {name!r} (shape {tuple(p.shape)}) has DTensor placements {p.placements}: a Partial "
                f"parameter holds pending sums, not values; make it Replicate() or Shard(d) first "
                f"(p.redistribute(mesh, [Replicate()])) or a plain tensor"
            )
        if isinstance(placement, Shard):
            split.append(dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"parameter {name!r} (shape {tuple(p.shape)}) has DTensor placements {p.placements}; FSDP composes "
                f"with Shard (tensor/expert parallel weights) and Replicate placements; redistribute it to one of "
                f"them or keep it a plain tensor"
            )
    return tuple(split)
