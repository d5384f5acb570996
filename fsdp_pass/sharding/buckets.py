"""Plan the buckets of a set of parameters: checks, module units, merging, the planner (setup time).

Planning reads only names, shapes, dtypes and the mesh's sizes; it allocates nothing and changes
no parameter, so an error leaves the module untouched. :mod:`fsdp_pass.sharding.materialize`
turns the plans into DBuffers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.nn as nn

from .blocks import block_for_placements
from ..planner import Layout, TensorSpec, plan_buckets
from ..buckets.mesh import ShardingMesh
from ..tensor.ragged_tensor import RaggedShardTensor, ragged_part
from .mesh_roles import ParallelMesh

__all__ = ["BucketPlan", "ShardingConfig", "check_one_device", "default_min_bucket_bytes", "min_bucket_bytes_for",
           "numbered_unit", "plan_parameter_buckets", "unit_key"]


@dataclass(frozen=True)
class ShardingConfig:
    """How parameters are bucketed and padded.

    Attributes:
        bucket_numel: most elements in one bucket (None: one bucket per unit, split only by block sizes).
        align_bytes: every tensor start and the per-rank shard size are multiples of this many bytes.
        param_dtype: dtype parameters are gathered in (affects alignment in elements).
        min_bucket_bytes: neighbouring units are grouped into buckets of at least this many bytes (None: the cost
            model of :func:`default_min_bucket_bytes`; 0: one bucket per unit).
        one_unit: the parameters are one unit, not a unit per module (:func:`unit_key`): FSDP2's group of one
            ``fully_shard`` call that holds no numbered child ([Note: a fully_shard call is one unit]).
    """

    bucket_numel: int | None = None
    align_bytes: int = 16
    param_dtype: torch.dtype | None = None
    min_bucket_bytes: int | None = None
    one_unit: bool = False


@dataclass
class BucketPlan:
    """One bucket to allocate: its layout and the parameters it will hold."""

    layout: Layout  # names are parameter FQNs
    dtype: torch.dtype  # of the master shard
    trainable: bool  # whether the shard collects gradients
    mesh: ShardingMesh  # the ranks this bucket is sharded over
    params: dict[str, nn.Parameter]  # FQN → the parameter object to swap (a superset of layout.names)
    fp8_tile: int | None = None  # its parameters are gathered in FP8 ([Note: FP8 all-gather])


# [Note: the bucket cost model]
# One collective takes latency + bytes / bandwidth. Below latency x bandwidth bytes (what one
# latency moves) it spends more of its time on the fixed cost than on moving data, so units smaller
# than that are grouped with their neighbours. The constants are per device type: gloo's measured on
# the 2-core CPU machine by benchmarks/collective_cost.py (docs/benchmarks.md, "The bucket cost
# model": all-gathers 1.2-1.5 ms + 1.3-1.5 GB/s, reduce-scatters 0.9-1.5 ms + 0.6-0.7 GB/s, bytes
# counted whole-bucket; a bucket's step has two all-gathers and one reduce-scatter, so per collective
# about 1.3 ms and 1 GB/s: 1.3 MB); NCCL's are typical figures within a node (~15 us, ~100 GB/s:
# 1.5 MB), not measured here.
_LATENCY_S = {"cpu": 1.3e-3, "cuda": 15e-6}
_BANDWIDTH_BYTES_PER_S = {"cpu": 1e9, "cuda": 100e9}


def min_bucket_bytes_for(latency_s: float, bandwidth_bytes_per_s: float) -> int:
    """Smallest bucket worth its own collective: latency x bandwidth ([Note: the bucket cost model])."""
    return int(latency_s * bandwidth_bytes_per_s)


def default_min_bucket_bytes(device_type: str) -> int:
    """:func:`min_bucket_bytes_for` with the constants of ``device_type`` (any accelerator: NCCL's)."""
    kind = device_type if device_type in _LATENCY_S else "cuda"
    return min_bucket_bytes_for(_LATENCY_S[kind], _BANDWIDTH_BYTES_PER_S[kind])


def unit_key(name: str) -> str:
    """The module unit a parameter belongs to: its name up to the first numeric index, else its module.

    ``layers.3.attn.wq.weight`` → ``layers.3``; ``0.weight`` → ``0``; ``tok_embeddings.weight`` →
    ``tok_embeddings``; a parameter of the root module is a unit of its own. Small units are
    merged with their neighbours by size (:func:`plan_parameter_buckets`).
    """
    numbered = numbered_unit(name)
    return numbered if numbered is not None else name.rsplit(".", 1)[0]


def numbered_unit(name: str) -> str | None:
    """``name`` up to its first numeric index (``layers.3.attn.wq.weight`` → ``layers.3``), None without one."""
    m = re.match(r"^((?:.*?\.)?\d+)(\.|$)", name)
    return m.group(1) if m else None


def check_one_device(named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise unless every parameter is on one device."""
    devices = {p.device for _, p in named_params}
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on several devices {sorted(map(str, devices))}; move the model to one device "
            f"(model.to(device)) before sharding"
        )


def check_parameter(name: str, p: torch.Tensor) -> None:
    """Raise unless ``p`` (not sharded yet) can become a RaggedShard parameter."""
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


def plan_parameter_buckets(
    todo: list[tuple[str, nn.Parameter]],
    mesh: ShardingMesh | ParallelMesh,
    config: ShardingConfig,
    block_sizes: Mapping[str, int],
    fp8_tiles: Mapping[str, int] | None = None,
) -> list[BucketPlan]:
    """Bucket plans for parameters not sharded yet, given in first-use order (each object once).

    Units (:func:`unit_key`, or one for all with ``config.one_unit``) in first-use order; within a unit, one
    group per (dtype, trainable, sharding mesh); groups under ``config.min_bucket_bytes`` merge with their
    neighbours; then the planner lays out each group (split at ``config.bucket_numel``). Parameters in ``fp8_tiles``
    (gathered in FP8) form groups of their own ([Note: FP8 all-gather] in buckets/gather.py).
    """
    fp8_tiles = fp8_tiles or {}
    check_one_device(todo)
    units: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    for name, p in todo:
        unit = "" if config.one_unit else unit_key(name)
        key = (unit, p.dtype, p.requires_grad, mesh.for_parameter(name, p), fp8_tiles.get(name))
        units.setdefault(key, []).append((name, p))
    min_bytes = config.min_bucket_bytes
    if min_bytes is None:
        min_bytes = default_min_bucket_bytes(mesh.device_type)
    groups = _merge_small_units(list(units.items()), min_bytes, config.bucket_numel)

    plans: list[BucketPlan] = []
    for (_, dtype, trainable, bucket_mesh, fp8_tile), members in groups:
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
            specs.append(TensorSpec(name, local.numel(), block_for_placements(p, block), tuple(local.shape)))
        by_name = dict(members)
        for layout in plan_buckets(specs, bucket_mesh.shard_size, align=align, max_bucket_numel=config.bucket_numel):
            plans.append(BucketPlan(layout, dtype, trainable, bucket_mesh, by_name, fp8_tile))
    return plans


def _merge_small_units(units: list, min_bytes: int, max_numel: int | None) -> list:
    """Group neighbouring units of one kind (dtype, trainability, mesh, FP8) into buckets of at least
    ``min_bytes``: a group takes the next unit while it is still under ``min_bytes`` (and the sum stays
    within ``max_numel``); a group left under ``min_bytes`` joins the group before it when it can.

    A unit at or above ``min_bytes`` is never merged with another at or above it, so units of about
    the threshold's size pair up rather than chain into one bucket."""

    def size(members) -> tuple[int, int]:
        numel = sum(ragged_part(p).numel() for _, p in members)
        return numel, numel * members[0][1].element_size()

    def joinable(a, b) -> bool:
        return a[0][1:] == b[0][1:] and (max_numel is None or size(a[1])[0] + size(b[1])[0] <= max_numel)

    def close_last(groups: list) -> None:  # a finished group still under min_bytes joins its predecessor
        if len(groups) > 1 and size(groups[-1][1])[1] < min_bytes and joinable(groups[-2], groups[-1]):
            _, last = groups.pop()
            groups[-1] = (groups[-1][0], groups[-1][1] + last)

    merged: list = []
    for key, members in units:
        unit = (key, list(members))
        if merged and size(merged[-1][1])[1] < min_bytes and joinable(merged[-1], unit):
            merged[-1] = (merged[-1][0], merged[-1][1] + unit[1])
            continue
        close_last(merged)
        merged.append(unit)
    close_last(merged)
    return merged
