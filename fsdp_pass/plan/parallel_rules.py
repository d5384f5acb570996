"""Megatron-style tensor and expert parallelism by parameter name, for planning.

``python -m fsdp_pass plan --tp N --ep N`` splits parameters as a Megatron-style model would:
attention and MLP projections column- or row-parallel over the TP ranks, experts over the EP ranks
(stacked expert tensors on their first dim; per-expert modules dealt out, ``E/ep`` to each EP rank).
:func:`composed_mesh_and_parameters` builds the named ``(rep, dp, ep, tp)`` mesh and turns the split
parameters into meta-device DTensors on it, ready for ``shard_parameters``.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ..sharding.mesh_roles import ParallelMesh, resolve_mesh

__all__ = ["composed_mesh_and_parameters"]

# Megatron tensor parallelism by parameter name: column-parallel (split outputs, dim 0) and
# row-parallel (split inputs, dim 1) projections.
_COLUMN_PARALLEL = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|wq|wk|wv|w1|w3)\.weight$")
_ROW_PARALLEL = re.compile(r"(o_proj|down_proj|wo|w2)\.weight$")
_STACKED_EXPERTS = re.compile(r"\.experts\.[A-Za-z_]")  # experts.gate_up_proj, not experts.3.up_proj
_EXPERT_MODULE = re.compile(r"^(.*\.experts\.)(\d+)\.")  # experts.3.up_proj: one module per expert


def composed_mesh_and_parameters(
    mesh_shape: tuple[int, ...], tp: int, ep: int, params: list[tuple[str, nn.Parameter]]
) -> tuple[ParallelMesh, list[tuple[str, nn.Parameter]]]:
    """A named ``(rep, dp, ep, tp)`` mesh (size-1 dims left out) and the parameters as TP/EP DTensors."""
    sizes = {"rep": mesh_shape[0] if len(mesh_shape) == 2 else 1, "dp": mesh_shape[-1] // ep, "ep": ep, "tp": tp}
    names = tuple(n for n, size in sizes.items() if size > 1 or n == "dp")
    mesh = init_device_mesh("cpu", tuple(sizes[n] for n in names), mesh_dim_names=names)
    experts: dict[str, int] = {}  # per-expert modules: experts per MoE layer
    for name, _ in params:
        match = _EXPERT_MODULE.match(name)
        if match:
            experts[match.group(1)] = max(experts.get(match.group(1), 0), int(match.group(2)) + 1)
    composed = []
    for name, p in params:
        split = None
        module = _EXPERT_MODULE.match(name) if ep > 1 else None
        if module and experts[module.group(1)] % ep == 0:
            # Expert slot j of every EP rank (expert k*E/ep + j on rank k) planned as one tensor split
            # Shard(0) over EP: rank 0's experts stand for every rank's, which hold the same shapes.
            if int(module.group(2)) >= experts[module.group(1)] // ep:
                continue
            p = nn.Parameter(torch.empty((ep * p.shape[0], *p.shape[1:]), dtype=p.dtype, device="meta"),
                             requires_grad=p.requires_grad)
            split = ("ep", 0)
        elif ep > 1 and _STACKED_EXPERTS.search(name) and p.shape[0] % ep == 0:
            split = ("ep", 0)
        elif tp > 1 and _COLUMN_PARALLEL.search(name) and p.dim() == 2 and p.shape[0] % tp == 0:
            split = ("tp", 0)
        elif tp > 1 and _ROW_PARALLEL.search(name) and p.dim() == 2 and p.shape[1] % tp == 0:
            split = ("tp", 1)
        if split is not None:
            dim_name, dim = split
            local = list(p.shape)
            local[dim] //= sizes[dim_name]
            p = nn.Parameter(DTensor.from_local(torch.empty(local, dtype=p.dtype, device="meta"), mesh[dim_name],
                                                [Shard(dim)], run_check=False, shape=p.shape, stride=p.stride()),
                             requires_grad=p.requires_grad)
        composed.append((name, p))
    shard_dims = tuple(n for n in ("dp", "ep") if n in names)
    model_dims = tuple(n for n in ("ep", "tp") if n in names)
    replicate = "rep" if "rep" in names else None
    return resolve_mesh(mesh, shard_dims, "the planning mesh", replicate_dim=replicate, model_dims=model_dims), composed
