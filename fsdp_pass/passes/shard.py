"""Pass 2: give every parameter of the graph a bucket, sharding the ones not sharded yet.

Parameters not yet sharded are planned into buckets (first-use order, grouped by module unit) and
swapped in place into RaggedShard parameters. Parameters already sharded (an earlier graph, a
recompile, a graph break, ``fully_shard``) keep their layout.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..runtime.dbuffer import DBuffer
from ..runtime.mesh import ShardingMesh
from ..runtime.sharding import ShardingConfig, bucket_of, shard_parameters
from .detect import ParamSite

__all__ = ["assign_buckets"]


def assign_buckets(
    sites: Sequence[ParamSite],
    blocks: Mapping[str, int],
    mesh: ShardingMesh,
    config: ShardingConfig,
) -> tuple[dict[str, tuple[DBuffer, str]], list[DBuffer]]:
    """Return ``{fqn: (DBuffer, name in that buffer)}`` for every site, and the DBuffers made now."""
    new = shard_parameters(((s.name, s.param) for s in sites), mesh, config, blocks)
    return {s.name: bucket_of(s.param) for s in sites}, new
