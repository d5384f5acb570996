"""Check that every rank is about to issue the same collectives (a mismatch would hang, not fail)."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .mesh_roles import check_rank_in_mesh, default_device_type

__all__ = ["check_ranks_agree"]


def _digest(items: Sequence[str]) -> int:
    return int.from_bytes(hashlib.sha256("\n".join(items).encode()).digest()[:7], "little")


def _groups(mesh: DeviceMesh | None) -> list[dist.ProcessGroup | None]:
    """The groups to check over: each dim of ``mesh`` with more than one rank (the default group without a mesh)."""
    if mesh is None:
        return [None] if dist.get_world_size() > 1 else []
    check_rank_in_mesh(mesh)
    return [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]


def check_ranks_agree(items: Sequence[str], what: str, mesh: DeviceMesh | None = None) -> None:
    """Raise on every rank of ``mesh`` if ``items`` differ between its ranks.

    ``mesh`` is the mesh the graph is sharded over (``options['mesh']``); None means every rank of
    the default group. Only that mesh's ranks take part: other ranks (another pipeline stage) may
    compile other graphs at other times. One small collective per mesh dim (skipped without a
    process group and on the single-process fake group, whose collectives carry no data). The
    error lists this rank's items so the user can compare logs, e.g. a parameter used by the graph
    on some ranks only.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend() == "fake":
        return
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        return  # not a mesh: resolving it raises the error that says so
    groups = _groups(mesh)
    if not groups:
        return
    digest = _digest(items)
    # on the mesh's device: a group made with init_process_group("nccl") has no backend for CPU tensors
    device = torch.device(mesh.device_type if mesh is not None else default_device_type())
    if len(groups) == 1:  # one group: name the ranks that differ
        group = groups[0]
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        ranks = list(range(len(every))) if group is None else dist.get_process_group_ranks(group)
        differing = [ranks[i] for i, t in enumerate(every) if int(t) != int(every[0])]
        detail = f"ranks {differing} differ from rank {ranks[0]}"
    else:  # a grid of groups: the largest and smallest digest, reduced over each dim in turn, reach every rank
        bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        for group in groups:
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
        differing = [] if int(bounds[0]) == -int(bounds[1]) else ["some"]
        detail = f"not every rank of {mesh} has the same"
    if differing:
        raise RuntimeError(
            f"ranks disagree on {what} ({detail}); this rank ({dist.get_rank()}) has: "
            f"{list(items)[:20]}{' ...' if len(items) > 20 else ''}. Every rank of the mesh must run the same "
            f"model code path with the same parameters; make data-dependent branches that skip "
            f"parameters identical on all ranks"
        )
