"""Whole (unsharded) state dicts of a sharded model: export on rank 0, load on every rank.

``torch.distributed.checkpoint.state_dict.get_model_state_dict(..., full_state_dict=True)`` gathers
DTensors only; a RaggedShard parameter would come back as this rank's piece. These two functions
are the full-state counterparts for models sharded by ``fully_shard`` or the ``vescale`` backend,
including tensor/expert-parallel DTensor parameters whose local tensors are RaggedShard
([Note: FSDP over TP/EP] in sharding/materialize.py).
For sharded checkpoints that load at any world size, use DCP (``torch.distributed.checkpoint``).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .runtime.ragged_tensor import RaggedShardTensor, local_block

__all__ = ["get_full_state_dict", "set_full_state_dict", "whole_tensor"]


def _is_distributed(t: torch.Tensor) -> bool:
    return isinstance(t, (RaggedShardTensor, DTensor))


def get_full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered whole (plain tensors).

    A collective: call it on every rank of the model's mesh, in the same order. With ``rank0_only``
    only the model's first rank (coordinate 0 on every mesh its parameters use: global rank 0 for a
    mesh over the world, the stage's first rank for a pipeline stage sharded over a sub-mesh) keeps
    the result; the other ranks get ``{}`` (they still take part in the gathers). ``cpu_offload``
    moves the result to the CPU.
    """
    module = getattr(model, "_orig_mod", model)
    keep = not rank0_only or _first_rank_of_model(module)
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        whole = whole_tensor(value) if _is_distributed(value) else value.detach()
        if keep:
            out[name] = whole.cpu() if cpu_offload else whole
    return out


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The global value of a sharded tensor: FSDP's pieces gathered first, then the TP/EP blocks.

    Gathering the local tensor first also serves ``Replicate()`` DTensors, whose ``full_tensor()``
    issues no collective and would hand back the RaggedShard piece.
    """
    if isinstance(t, DTensor) and isinstance(t._local_tensor, RaggedShardTensor):
        local = t._local_tensor.full_tensor()
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride()).full_tensor()
    return t.full_tensor()


def _first_rank_of_model(module: nn.Module) -> bool:
    """Whether this rank is at coordinate 0 of every mesh the module's sharded parameters use."""
    from .runtime.dbuffer import bucket_of, is_sharded

    if not dist.is_initialized():
        return True
    meshes = {}
    for p in module.parameters():
        if isinstance(p, DTensor):
            meshes[id(p.device_mesh)] = p.device_mesh
        if is_sharded(p):
            mesh = bucket_of(p)[0].mesh.mesh
            if mesh is not None:
                meshes[id(mesh)] = mesh
    if not meshes:
        return dist.get_rank() == 0
    return all(all(c == 0 for c in (m.get_coordinate() or [1])) for m in meshes.values())


@torch.no_grad()
def set_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load whole tensors (every rank passes the same ``state``): each rank keeps only its piece.

    No communication. ``strict`` raises on missing or unexpected keys, like ``load_state_dict``.
    """
    module = getattr(model, "_orig_mod", model)
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(
            f"set_full_state_dict: missing keys {missing}, unexpected keys {unexpected}; pass the state dict of the "
            f"same model (get_full_state_dict) or strict=False"
        )
    for name, target in own.items():
        if name not in state:
            continue
        full = state[name]
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(
                f"set_full_state_dict: {name!r} has shape {tuple(full.shape)} but the model's is "
                f"{tuple(target.shape)}; pass whole (unsharded) tensors of the model's shapes"
            )
        if isinstance(target, DTensor):  # tensor/expert parallel: this rank's block, then its RaggedShard piece
            block = local_block(full, target._spec)
            target._local_tensor.copy_(block.to(target.device, target.dtype))
        else:
            target.copy_(full.to(target.device, target.dtype))
