"""Pass 2: give every parameter of the graph a bucket, sharding the ones not sharded yet.

The user's mesh gets its roles (:mod:`fsdp_pass.sharding.mesh_roles`), every parameter its block
(:mod:`fsdp_pass.sharding.blocks`, with the rows the graph asks for), then parameters not sharded yet are
planned into buckets (first-use order, grouped by module unit; :mod:`fsdp_pass.sharding.buckets`)
and swapped in place into RaggedShard parameters (:mod:`fsdp_pass.sharding.materialize`).
Parameters already sharded (an earlier graph, a recompile, a graph break, ``fully_shard``) keep
their layout. The compiled modules' parameters the graph does not read are sharded too
(:mod:`fsdp_pass.compile.passes.unread`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.nn as nn

from ...options import Options
from ...buckets.dbuffer import DBuffer, is_unsharded
from ...tensor.ragged_tensor import bucket_of
from ...buckets.mesh import check_mesh_is_current
from .detect import ParamSite, graph_block_rows
from .unread import shard_unread_parameters, shard_with_options

__all__ = ["Sharded", "shard_sites"]


@dataclass
class Sharded:
    """What pass 2 gives the rewrite pass."""

    buckets: dict[str, tuple[DBuffer, str]]  # every site's name → (its DBuffer, its name in that buffer), by identity
    new: list[DBuffer]  # the DBuffers this call made (parameters sharded now)


def shard_sites(sites: Sequence[ParamSite], opts: Options) -> Sharded:
    """Pass 2 with the backend's options (``fp8_all_gather``: [Note: FP8 all-gather] in buckets/gather.py)."""
    inside_unshard = [s.name for s in sites if is_unsharded(s.param)]
    if inside_unshard:
        raise RuntimeError(
            f"the compiled model was called inside fsdp_pass.unshard (parameter {inside_unshard[0]!r} holds its whole "
            f"value there); call the original module eagerly inside the block, or leave the block first"
        )
    named = [(s.name, s.param) for s in sites]
    new = shard_with_options(named, opts, {s.name: graph_block_rows(s) for s in sites})  # [Note: FP8 all-gather]
    new += shard_unread_parameters(_traced_modules(sites), opts)  # [Note: parameters no graph reads]
    buckets = {s.name: bucket_of(s.param) for s in sites}
    for buf, _ in buckets.values():
        check_mesh_is_current(buf)  # [Note: wrappers around a sharded model]
    for s in sites:
        _check_trainable_bucket(s.name, s.param)
    if opts.gradient_divide_factor is not None:
        for buf, _ in buckets.values():
            buf.apply_settings(gradient_divide_factor=float(opts.gradient_divide_factor))
    return Sharded(buckets, new)


def _check_trainable_bucket(name: str, p: nn.Parameter) -> None:
    """A parameter frozen when it was sharded sits in a bucket that collects no gradient: refuse to train it
    once unfrozen, rather than leave its ``.grad`` None ([Note: the gradient state of a parameter])."""
    buf, _ = bucket_of(p)
    if p.requires_grad and not buf.shard.requires_grad:
        raise RuntimeError(
            f"parameter {name!r} (shape {tuple(p.shape)}) was frozen (requires_grad=False) when it was sharded, so "
            f"its bucket collects no gradient, but it requires grad now; unfreeze it before fully_shard or before "
            f"the first compiled call (which shards the model), or keep it frozen"
        )


def _traced_modules(sites: Sequence[ParamSite]) -> list[nn.Module]:
    """The outermost modules the traced frame reached the graph's parameters through (``L['self']``, a global
    model, a closure's); none when the backend runs outside Dynamo."""
    return list({id(s.root): s.root for s in sites if s.root is not None}.values())
