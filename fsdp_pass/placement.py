"""RaggedShard: the sharding format, as pure math over shapes and numbers.

A tensor is flattened row-major and cut into equal *blocks* of ``block`` elements (the atomic unit
that no rank boundary may cut: one element, one row, 128 rows, the whole tensor). Rank ``r`` holds
``local_units[r]`` consecutive blocks, zero allowed, so every rank's piece is one contiguous range
of the flat tensor::

    units = (2, 0, 3)        # 5 blocks over 3 ranks
    rank 0: blocks [0, 2)    rank 1: nothing    rank 2: blocks [2, 5)

Nothing here imports ``torch.distributed``; the runtime builds on these functions.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Sequence

__all__ = [
    "RaggedShard",
    "flat_range_boxes",
    "local_view_shape",
    "numel_of",
    "transfer_splits",
]


def numel_of(shape: Sequence[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for a 0-dim tensor)."""
    return math.prod(shape)


class RaggedShard:
    """How one tensor is split over the ranks of one mesh dimension.

    Args:
        block: elements per atomic block of the flattened tensor (must divide its numel).
        local_units: blocks held by each rank, in rank order; zeros allowed.

    Rank ``r`` holds flat elements ``[block * sum(units[:r]), block * sum(units[:r+1]))``.

    Stored compactly: the world size and the counts of the ranks from the first to the last one
    that holds anything. In a planned bucket a tensor spans a few of thousands of ranks, so a
    placement costs its span, not the world size (:meth:`spanning` builds one that way).
    """

    __slots__ = ("block", "world_size", "first", "span")

    def __init__(self, block: int, local_units: Sequence[int]) -> None:
        units = tuple(map(int, local_units))
        if not units:
            raise ValueError("RaggedShard needs one entry of local_units per rank, got none")
        if min(units) < 0:
            raise ValueError(f"RaggedShard local_units must be >= 0, got {units}")
        held = [r for r, u in enumerate(units) if u]
        first, last = (held[0], held[-1] + 1) if held else (0, 0)
        self._set(block, len(units), first, units[first:last])

    @classmethod
    def spanning(cls, block: int, world_size: int, first: int, span: Sequence[int]) -> "RaggedShard":
        """``span[i]`` blocks on rank ``first + i`` and none elsewhere (O(span), not O(world size))."""
        if first < 0 or first + len(span) > world_size or (span and min(span) < 0):
            raise ValueError(f"RaggedShard span {list(span)} from rank {first} does not fit {world_size} ranks")
        made = cls.__new__(cls)
        units = tuple(map(int, span))
        lead = next((i for i, u in enumerate(units) if u), len(units))
        trail = len(units) - next((i for i, u in enumerate(reversed(units)) if u), len(units))
        made._set(block, world_size, first + lead if lead < trail else 0, units[lead:trail])
        return made

    def _set(self, block: int, world_size: int, first: int, span: tuple[int, ...]) -> None:
        if block < 1:
            raise ValueError(f"RaggedShard block must be >= 1 element, got {block}")
        object.__setattr__(self, "block", int(block))
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "first", first)
        object.__setattr__(self, "span", span)

    def __setattr__(self, name, value):
        raise AttributeError("RaggedShard is immutable")

    def __eq__(self, other) -> bool:
        if not isinstance(other, RaggedShard):
            return NotImplemented
        return (self.block, self.world_size, self.first, self.span) == (
            other.block, other.world_size, other.first, other.span)

    def __hash__(self) -> int:
        return hash((self.block, self.world_size, self.first, self.span))

    def __reduce__(self):
        return (RaggedShard.spanning, (self.block, self.world_size, self.first, self.span))

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def even(cls, numel: int, world_size: int, block: int = 1) -> "RaggedShard":
        """Blocks spread as evenly as possible, the first ranks taking one more."""
        blocks = _block_count(numel, block, "tensor")
        base, extra = divmod(blocks, world_size)
        return cls(block, tuple(base + (r < extra) for r in range(world_size)))

    @classmethod
    def on_root(cls, numel: int, world_size: int, root: int, block: int | None = None) -> "RaggedShard":
        """The whole tensor on ``root`` and nothing elsewhere (the layout Muon computes on)."""
        if not 0 <= root < world_size:
            raise ValueError(f"root {root} is outside the {world_size} ranks; pick a root in [0, {world_size})")
        block = numel if block is None else block
        blocks = _block_count(numel, block, "tensor") if numel else 0
        return cls.spanning(max(block, 1), world_size, root, (blocks,))

    # -- queries ------------------------------------------------------------------------------
    @property
    def local_units(self) -> tuple[int, ...]:
        """Blocks held by every rank (a tuple of ``world_size`` counts, built on request)."""
        return (0,) * self.first + self.span + (0,) * (self.world_size - self.first - len(self.span))

    @property
    def num_blocks(self) -> int:
        return sum(self.span)

    @property
    def numel(self) -> int:
        """Elements of the tensor this placement describes."""
        return self.block * self.num_blocks

    def local_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s piece in the flattened tensor."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a RaggedShard of {self.world_size} ranks")
        i = min(max(rank - self.first, 0), len(self.span))
        start = sum(self.span[:i])
        return start * self.block, (start + self.local_units_of(rank)) * self.block

    def local_units_of(self, rank: int) -> int:
        """Blocks ``rank`` holds."""
        i = rank - self.first
        return self.span[i] if 0 <= i < len(self.span) else 0

    def local_numel(self, rank: int) -> int:
        return self.local_units_of(rank) * self.block

    def ranges(self) -> list[tuple[int, int]]:
        """``local_range`` of every rank, in rank order."""
        ends = [0, *accumulate(self.local_units)]
        return [(a * self.block, b * self.block) for a, b in zip(ends, ends[1:])]

    def sub_range(self, start: int, end: int) -> "RaggedShard":
        """The placement of flat elements ``[start, end)`` as a tensor of their own (element blocks):
        each rank holds the part of its piece inside the range, still one contiguous run."""
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {self.numel} elements")
        return RaggedShard(1, [max(0, min(end, b) - max(start, a)) for a, b in self.ranges()])

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """The trailing-dims shape ``rank``'s piece can be viewed as (see :func:`local_view_shape`)."""
        return local_view_shape(shape, *self.local_range(rank))

    def validate(self, shape: Sequence[int], world_size: int, name: str = "tensor") -> None:
        """Raise ``ValueError`` naming ``name`` unless this placement describes ``shape`` on ``world_size`` ranks."""
        numel = numel_of(shape)
        if self.world_size != world_size:
            raise ValueError(
                f"{name}: RaggedShard has {self.world_size} local_units entries but the mesh has "
                f"{world_size} ranks; give exactly one block count per rank (zeros allowed)"
            )
        blocks = _block_count(numel, self.block, name, tuple(shape))
        if self.num_blocks != blocks:
            raise ValueError(
                f"{name}: local_units {self.local_units} sum to {self.num_blocks} blocks but shape "
                f"{tuple(shape)} has {blocks} blocks of {self.block} elements; make the units sum to {blocks}"
            )

    def __repr__(self) -> str:
        if self.world_size <= 16:
            return f"RaggedShard(block={self.block}, local_units={list(self.local_units)})"
        # Thousands of ranks: run-length encode, "4x1020" = 1020 ranks holding 4 blocks each.
        runs: list[list[int]] = []
        for u in self.local_units:
            if runs and runs[-1][0] == u:
                runs[-1][1] += 1
            else:
                runs.append([u, 1])
        text = ", ".join(f"{u}x{n}" if n > 1 else str(u) for u, n in runs)
        return f"RaggedShard(block={self.block}, local_units=[{text}] over {self.world_size} ranks)"


def _block_count(numel: int, block: int, name: str, shape: tuple[int, ...] | None = None) -> int:
    if block < 1 or numel % block:
        what = f"shape {shape} ({numel} elements)" if shape is not None else f"{numel} elements"
        raise ValueError(
            f"{name}: block of {block} elements does not divide {what}; choose a block that divides "
            f"the element count (a divisor of a row, a multiple of the row size that divides the rows, "
            f"or the whole tensor)"
        )
    return numel // block


def local_view_shape(shape: Sequence[int], start: int, end: int) -> tuple[int, ...]:
    """Shape of the flat range ``[start, end)`` of a row-major ``shape`` tensor as a trailing-dims view.

    The range is viewed as ``(n, *shape[k:])`` for the smallest ``k`` whose trailing size divides both
    ends of the range, so a range of whole rows of a matrix comes back as ``(rows, cols)`` and a cut
    inside a row as ``(end - start,)``. An empty range is ``(0, *shape[1:])`` for tensors of 2+ dims.
    """
    shape = tuple(shape)
    if start == end:
        return (0, *shape[1:]) if len(shape) > 1 else (0,)
    for k in range(1, len(shape) + 1):
        trailing = numel_of(shape[k:])
        if start % trailing == 0 and end % trailing == 0:
            return ((end - start) // trailing, *shape[k:])
    return (end - start,)


def flat_range_boxes(
    shape: Sequence[int], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split the flat range ``[start, end)`` of a row-major tensor into disjoint boxes.

    Each box is ``(offsets, sizes)`` in the tensor's N-d coordinates, the form distributed
    checkpoints store. A contiguous range needs at most ``2 * ndim - 1`` boxes: partial rows on the
    leading edge, one slab of whole leading-dim slices, partial rows on the trailing edge.
    """
    shape = tuple(shape)
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    return _boxes(shape, start, end)


def _boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes of ``[start, end)`` (non-empty, within bounds) of a tensor of ``shape`` (ndim >= 1)."""
    inner = numel_of(shape[1:])
    if len(shape) == 1:
        return [((start,), (end - start,))]
    first, last = start // inner, (end - 1) // inner
    head_lo, tail_hi = start - first * inner, end - last * inner
    if first == last:  # within one leading slice: recurse into it
        return [((first, *o), (1, *s)) for o, s in _boxes(shape[1:], head_lo, tail_hi)]
    boxes = []
    slab_lo, slab_hi = first, last + 1
    if head_lo:  # partial leading slice
        boxes += [((first, *o), (1, *s)) for o, s in _boxes(shape[1:], head_lo, inner)]
        slab_lo = first + 1
    tail = []
    if tail_hi != inner:  # partial trailing slice
        tail = [((last, *o), (1, *s)) for o, s in _boxes(shape[1:], 0, tail_hi)]
        slab_hi = last
    if slab_hi > slab_lo:
        boxes.append(((slab_lo, *([0] * (len(shape) - 1))), (slab_hi - slab_lo, *shape[1:])))
    return boxes + tail


def transfer_splits(src: RaggedShard, dst: RaggedShard, rank: int) -> tuple[list[int], list[int]]:
    """Per-peer element counts for moving a tensor from layout ``src`` to ``dst`` (one all-to-all).

    Returns ``(send, recv)``: ``send[q]`` elements of ``rank``'s ``src`` piece go to rank ``q`` and
    ``recv[q]`` elements of its ``dst`` piece come from rank ``q``. Because every piece is one flat
    range, the pieces sent (and received) are consecutive in peer order, which is exactly the
    contract of an uneven ``all_to_all_single``.
    """
    if src.numel != dst.numel or src.world_size != dst.world_size:
        raise ValueError(
            f"cannot redistribute {src} to {dst}: both must describe the same element count "
            f"({src.numel} vs {dst.numel}) on the same number of ranks"
        )

    def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    src_ranges, dst_ranges = src.ranges(), dst.ranges()
    send = [overlap(src_ranges[rank], d) for d in dst_ranges]
    recv = [overlap(s, dst_ranges[rank]) for s in src_ranges]
    return send, recv
