"""Baseline shardings the planner is compared with (benchmarks/padding.py, tests/test_baselines.py).

* ``naive_concat``   concatenate, split evenly: no padding to speak of, but blocks are cut;
* ``fsdp2_shard0``   FSDP2's per-parameter Shard(0), dim 0 padded to a multiple of the world size;
* ``rowwise_concat`` Megatron-FSDP style: in order, rank boundaries on row boundaries only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from fsdp_pass.planner import TensorSpec, count_cut_blocks, plan

__all__ = ["BaselineLayout", "fsdp2_shard0", "naive_concat", "rowwise_concat"]

@dataclass(frozen=True)
class BaselineLayout:
    """Size figures of a baseline sharding of one bucket."""

    name: str
    world_size: int
    shard_size: int  # elements per rank (the largest rank, where ranks differ)
    numel: int
    blocks_cut: int  # rank boundaries that fall inside a block

    @property
    def padding(self) -> int:
        return self.world_size * self.shard_size - self.numel


def naive_concat(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> BaselineLayout:
    """Concatenate in order, split evenly (``S = ceil(E / m)``): no padding between tensors, blocks cut freely."""
    total = sum(s.numel for s in specs)
    per_rank = -(-total // world_size)
    S = -(-per_rank // align) * align  # rounded up to the alignment
    cut, cursor = 0, 0
    for s in specs:
        cut += count_cut_blocks(cursor, s.numel, s.block, S)
        cursor += s.numel
    return BaselineLayout("naive_concat", world_size, S, total, cut)


def fsdp2_shard0(specs: Sequence[TensorSpec], world_size: int) -> BaselineLayout:
    """FSDP2's per-parameter ``Shard(0)``: dim 0 padded to ``m * ceil(d0 / m)`` rows, per parameter."""
    S, cut = 0, 0
    for s in specs:
        rows = s.numel // s.row if s.numel else 0
        chunk_rows = -(-rows // world_size)
        S += chunk_rows * s.row
        if s.numel and chunk_rows:
            cut += count_cut_blocks(0, rows * s.row, s.block, chunk_rows * s.row)
    return BaselineLayout("fsdp2_shard0", world_size, S, sum(s.numel for s in specs), cut)


def rowwise_concat(specs: Sequence[TensorSpec], world_size: int, align: int = 8) -> BaselineLayout:
    """Megatron-FSDP style: tensors in the given order, rank boundaries only on row boundaries.

    Planned with each tensor's block set to its row (no permutation), so larger structure
    (a block of many rows) may still be cut.
    """
    rows = [TensorSpec(s.name, s.numel, s.row if s.numel else 1, s.shape) for s in specs]
    layout = plan(rows, world_size, align, orders=("given",))
    S = layout.shard_size
    cut = sum(count_cut_blocks(layout.offsets[s.name], s.numel, s.block, S) for s in specs)
    return BaselineLayout("rowwise_concat", world_size, S, sum(s.numel for s in specs), cut)
