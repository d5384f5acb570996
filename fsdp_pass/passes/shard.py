"""Pass 2: give every parameter of the graph a bucket, sharding the ones not sharded yet.

The user's mesh gets its roles (:mod:`fsdp_pass.sharding.mesh_roles`), every parameter its block
(:mod:`fsdp_pass.blocks`, with the rows the graph asks for), then parameters not sharded yet are
planned into buckets (first-use order, grouped by module unit; :mod:`fsdp_pass.sharding.buckets`)
and swapped in place into RaggedShard parameters (:mod:`fsdp_pass.sharding.materialize`).
Parameters already sharded (an earlier graph, a recompile, a graph break, ``fully_shard``) keep
their layout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

from ..blocks import block_size
from ..options import Options
from ..runtime.dbuffer import DBuffer, bucket_of, is_sharded, is_unsharded
from ..sharding.buckets import ShardingConfig
from ..sharding.fp8_select import lcm_blocks, select_fp8_weights
from ..sharding.materialize import shard_parameters
from ..sharding.mesh_roles import model_mesh_dims, resolve_mesh
from .detect import ParamSite, graph_block_rows

__all__ = ["Sharded", "shard_sites"]


@dataclass
class Sharded:
    """What pass 2 gives the rewrite pass."""

    buckets: dict[str, tuple[DBuffer, str]]  # every site's FQN → (its DBuffer, its name in that buffer)
    new: list[DBuffer]  # the DBuffers this call made (parameters sharded now)


def shard_sites(sites: Sequence[ParamSite], opts: Options) -> Sharded:
    """Pass 2 with the backend's options (``fp8_all_gather``: [Note: FP8 all-gather] in runtime/gather.py)."""
    inside_unshard = [s.name for s in sites if is_unsharded(s.param)]
    if inside_unshard:
        raise RuntimeError(
            f"the compiled model was called inside fsdp_pass.unshard (parameter {inside_unshard[0]!r} holds its whole "
            f"value there); call the original module eagerly inside the block, or leave the block first"
        )
    named = [(s.name, s.param) for s in sites]
    mesh = resolve_mesh(opts.mesh, opts.shard_dim, replicate_dim=opts.replicate_dim, model_dims=model_mesh_dims(named))
    blocks = {s.name: block_size(s.name, s.param, opts.block_sizes, graph_block_rows(s)) for s in sites}
    config = ShardingConfig(opts.bucket_size, opts.align_bytes, opts.param_dtype, opts.min_bucket_bytes)
    fp8_tiles, fp8_blocks, skipped = _fp8_plan(named, opts)
    blocks = lcm_blocks(blocks, fp8_blocks)  # [Note: FP8 all-gather]: whole panels of tile rows
    new = shard_parameters(named, mesh, config, blocks, fp8_tiles)
    for name, p in named:
        if name in skipped and is_sharded(p):
            bucket_of(p)[0].fp8_skipped[name] = skipped[name]
    return Sharded({s.name: bucket_of(s.param) for s in sites}, new)


def _fp8_plan(named, opts: Options) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
    """FP8 weights among the parameters not sharded yet (name → tile, name → block in elements),
    and the candidates left out (name → why).

    See [Note: FP8 all-gather] in runtime/gather.py.
    """
    if opts.fp8_all_gather is None:
        return {}, {}, {}
    todo = [(n, p) for n, p in named if not is_sharded(p)]
    chosen, skipped = select_fp8_weights(todo, opts.fp8_all_gather)
    if todo and not chosen:
        reasons = "; ".join(f"{n}: {why}" for n, why in list(skipped.items())[:3])
        warnings.warn(
            "options['fp8_all_gather'] found no eligible weight (2-D or stacked 3-D weights inside repeated units "
            "such as 'layers.3', rows a multiple of the tile, or names given in 'include')"
            + (f" ({reasons})" if reasons else "") + "; training proceeds with every parameter gathered in param_dtype",
            stacklevel=3,
        )
    return {n: opts.fp8_all_gather.tile for n in chosen}, chosen, skipped
