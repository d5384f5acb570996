"""Turn parameters into RaggedShard parameters backed by DBuffers (shared by ``fully_shard`` and the backend)."""

from __future__ import annotations

import itertools
import math
import re
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ..planner import Layout, TensorSpec, plan_buckets
from .dbuffer import DBuffer
from .mesh import ParallelMesh, ShardingMesh
from .ragged_tensor import RaggedShardTensor, ragged_part
from .swap import check_swappable, swap_in_place

__all__ = ["ShardingConfig", "bucket_of", "check_one_device", "is_sharded", "shard_parameters"]

_BUCKET_ATTR = "_fsdp_pass_bucket"
_bucket_ids = itertools.count()  # names buckets uniquely in graphs and logs


@dataclass(frozen=True)
class ShardingConfig:
    """How parameters are bucketed and padded.

    Attributes:
        bucket_numel: most elements in one bucket (None: one bucket per unit, split only by block sizes).
        align_bytes: every tensor start and the per-rank shard size are multiples of this many bytes.
        param_dtype: dtype parameters are gathered in (affects alignment in elements).
        min_bucket_bytes: units smaller than this are merged with their neighbours (None: the cost
            model of :func:`default_min_bucket_bytes`; 0: one bucket per unit).
    """

    bucket_numel: int | None = None
    align_bytes: int = 16
    param_dtype: torch.dtype | None = None
    min_bucket_bytes: int | None = None


# Collective cost model: time = latency + bytes / bandwidth. Below latency x bandwidth bytes a
# collective is latency-bound; at ten times that, latency is under 10% of the transfer. Rough
# figures: gloo on one host ~50 us and ~2 GB/s; NCCL within a node ~15 us and ~100 GB/s.
_LATENCY_S = {"cpu": 50e-6, "cuda": 15e-6}
_BANDWIDTH_BYTES_PER_S = {"cpu": 2e9, "cuda": 100e9}


def default_min_bucket_bytes(device_type: str) -> int:
    """Smallest bucket worth its own collective: ten times latency x bandwidth."""
    kind = device_type if device_type in _LATENCY_S else "cuda"
    return int(10 * _LATENCY_S[kind] * _BANDWIDTH_BYTES_PER_S[kind])


def is_sharded(p: torch.Tensor) -> bool:
    return isinstance(ragged_part(p), RaggedShardTensor) and hasattr(p, _BUCKET_ATTR)


def _block_for_placements(p: torch.Tensor, block: int) -> int:
    """Under ``Shard(d)`` with ``d > 0`` a rank boundary must not cut dims ``d:`` of the local tensor.

    Then every rank's piece is whole rows of the local block: a rectangle of the global tensor.
    """
    if not isinstance(p, DTensor):
        return block
    local = p._local_tensor
    for placement in p.placements:
        if isinstance(placement, Shard) and placement.dim > 0:
            block = math.lcm(block, math.prod(local.shape[placement.dim:]))
    return block


def bucket_of(p: torch.Tensor) -> tuple[DBuffer, str]:
    """The DBuffer holding a sharded parameter, and the parameter's name in it."""
    return getattr(p, _BUCKET_ATTR)


def unit_key(name: str) -> str:
    """The module unit a parameter belongs to: its name up to the first numeric index, else its module.

    ``layers.3.attn.wq.weight`` → ``layers.3``; ``0.weight`` → ``0``; ``tok_embeddings.weight`` →
    ``tok_embeddings``; a parameter of the root module is a unit of its own. Small units are
    merged with their neighbours by size (:func:`shard_parameters`).
    """
    m = re.match(r"^((?:.*?\.)?\d+)(\.|$)", name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0]


def check_one_device(named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise unless every parameter is on one device."""
    devices = {p.device for _, p in named_params}
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on several devices {sorted(map(str, devices))}; move the model to one device "
            f"(model.to(device)) before sharding"
        )


def _check_parameter(name: str, p: torch.Tensor) -> None:
    if is_sharded(p):
        return
    p = ragged_part(p)
    if isinstance(p, RaggedShardTensor):
        raise ValueError(f"parameter {name!r} is a RaggedShardTensor that no DBuffer owns; pass plain parameters")
    if not p.is_contiguous():
        raise ValueError(
            f"parameter {name!r} (shape {tuple(p.shape)}, stride {p.stride()}) is not contiguous; sharded "
            f"parameters are flat ranges of a row-major tensor. Make it contiguous before sharding, e.g. "
            f"module.{name.rsplit('.', 1)[-1]} = nn.Parameter(param.detach().contiguous())"
        )
    if p.is_complex() or not p.is_floating_point():
        raise TypeError(
            f"parameter {name!r} has dtype {p.dtype} (shape {tuple(p.shape)}); only real floating-point "
            f"parameters can be sharded; register it as a buffer (module.register_buffer) instead"
        )


def shard_parameters(
    named_params: Iterable[tuple[str, nn.Parameter]],
    mesh: ShardingMesh | ParallelMesh,
    config: ShardingConfig = ShardingConfig(),
    block_sizes: Mapping[str, int] | None = None,
) -> list[DBuffer]:
    """Plan buckets for the parameters (in the given order) and swap each into a RaggedShard parameter.

    Parameters already sharded are skipped (their DBuffer is kept). A parameter object listed twice
    (tied weights) is sharded once. Returns the new DBuffers. A tensor/expert-parallel DTensor
    parameter stays a DTensor; its local tensor becomes a RaggedShard tensor over the mesh dims
    its placements do not use (``mesh.for_parameter``).
    """
    block_sizes = dict(block_sizes or {})
    seen: set[int] = set()
    todo: list[tuple[str, nn.Parameter]] = []
    for name, p in named_params:
        _check_parameter(name, p)
        if id(p) in seen or is_sharded(p):
            continue
        seen.add(id(p))
        todo.append((name, p))
    check_one_device(todo)

    # Units in first-use order; within a unit, one group per (dtype, trainable, sharding mesh).
    units: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    for name, p in todo:
        units.setdefault((unit_key(name), p.dtype, p.requires_grad, mesh.for_parameter(name, p)), []).append((name, p))
    min_bytes = config.min_bucket_bytes
    if min_bytes is None:
        min_bytes = default_min_bucket_bytes(mesh.device_type)
    groups = _merge_small_units(list(units.items()), min_bytes, config.bucket_numel)

    # Plan every bucket and check every parameter before the first swap: an error must leave the
    # module untouched, never half sharded.
    plans: list[tuple[Layout, torch.dtype, bool, ShardingMesh, dict[str, nn.Parameter]]] = []
    for (_, dtype, trainable, bucket_mesh), members in groups:
        itemsize = min(dtype.itemsize, (config.param_dtype or dtype).itemsize)
        align = max(1, config.align_bytes // itemsize)
        specs = []
        for name, p in members:
            local = ragged_part(p)
            block = block_sizes.get(name, 1)
            if local.numel() % block:
                raise ValueError(
                    f"parameter {name!r} of shape {tuple(local.shape)} ({local.numel()} elements) cannot be split "
                    f"into blocks of {block} elements; choose a block size that divides it"
                )
            block = _block_for_placements(p, block)
            specs.append(TensorSpec(name, local.numel(), block, tuple(local.shape)))
        by_name = dict(members)
        for layout in plan_buckets(specs, bucket_mesh.shard_size, align=align, max_bucket_numel=config.bucket_numel):
            plans.append((layout, dtype, trainable, bucket_mesh, by_name))
    for name, p in todo:
        if not isinstance(p, DTensor):
            check_swappable(p, f"parameter {name!r}")

    buffers: list[DBuffer] = []
    for layout, dtype, trainable, bucket_mesh, by_name in plans:
        shapes = {n: ragged_part(by_name[n]).shape for n in layout.names}
        specs = {n: by_name[n]._spec for n in layout.names if isinstance(by_name[n], DTensor)}
        device = by_name[layout.names[0]].device
        if device.type == "meta":  # only the local shard is allocated; initialize_meta_parameters fills it
            device = torch.device(mesh.device_type)
        buf = DBuffer(layout, shapes, bucket_mesh, dtype, device, trainable, index=next(_bucket_ids), dtensor_specs=specs)
        for name in layout.names:
            if not by_name[name].is_meta:
                buf.load_full(name, ragged_part(by_name[name]))
        for name in layout.names:
            _swap_into_bucket(buf, name, by_name[name])
        if trainable:
            # The hook lives in C++ on the shard, out of the garbage collector's sight: a strong
            # reference to the buffer there would keep the whole model alive forever.
            buf.shard.register_post_accumulate_grad_hook(lambda _, ref=weakref.ref(buf): _attach_grads(ref))
        buffers.append(buf)
    return buffers


def _attach_grads(ref: weakref.ref) -> None:
    buf = ref()
    if buf is not None:
        buf.attach_grads()


def _merge_small_units(units: list, min_bytes: int, max_numel: int | None) -> list:
    """Merge neighbouring units (same dtype and trainability) while either side is under ``min_bytes``."""

    def size(members) -> tuple[int, int]:
        numel = sum(ragged_part(p).numel() for _, p in members)
        return numel, numel * members[0][1].element_size()

    merged: list = []
    for key, members in units:
        if merged:
            last_key, last = merged[-1]
            (last_numel, last_bytes), (numel, nbytes) = size(last), size(members)
            same_kind = last_key[1:] == key[1:]
            fits = max_numel is None or last_numel + numel <= max_numel
            if same_kind and fits and (last_bytes < min_bytes or nbytes < min_bytes):
                merged[-1] = (last_key, last + members)
                continue
        merged.append((key, list(members)))
    return merged


def _swap_into_bucket(buf: DBuffer, name: str, p: nn.Parameter) -> None:
    if isinstance(p, DTensor):
        # The DTensor (mesh, placements, global shape) stays; only its local tensor becomes a RaggedShard piece.
        p._local_tensor = buf.ragged(name, buf.local_piece(name))
    else:
        sharded = nn.Parameter(buf.ragged(name, buf.local_piece(name)), requires_grad=p.requires_grad)
        swap_in_place(p, sharded)
    setattr(p, _BUCKET_ATTR, (buf, name))
    buf.params[name] = p
