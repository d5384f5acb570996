"""The structure-aware planner: pack a bucket's tensors into one flat buffer of ``m * S`` elements.

Constraints (checked by :meth:`Layout.validate`):

* **no cut block** — every rank boundary ``k * S`` inside a tensor falls on one of its block boundaries;
* **contiguous tensors** — each tensor is one interval; padding only goes *between* tensors;
* **balanced load** — every rank holds exactly ``S`` elements;
* **alignment** — every tensor start and ``S`` are multiples of ``align`` elements (16-byte views).

Finding the smallest ``S`` is NP-hard in general. The heuristic: for a fixed tensor order and a fixed
``S``, placing each tensor at its *earliest valid start* is optimal (a smaller cursor never removes
options for later tensors), so feasibility is one linear pass. A tensor that contains a whole shard
forces ``S`` to be a multiple of its block, so ``S`` is searched (binary search) over multiples of
candidate alignments: running LCMs of block sizes, in ascending block order and in descending tensor
size order. Five tensor orders are tried (given; by block size and by size, each descending and
ascending); the smallest ``S`` wins.

Pure Python over numbers: nothing here imports ``torch``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .placement import RaggedShard

__all__ = ["Layout", "TensorSpec", "count_cut_blocks", "plan", "plan_buckets"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place: its name, element count and block size (elements; must divide numel).

    ``shape`` is optional; the baselines that shard by rows (FSDP2, row-wise) need it.
    """

    name: str
    numel: int
    block: int = 1
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"{self.name}: numel must be >= 0, got {self.numel}")
        if self.block < 1 or (self.numel and self.numel % self.block):
            raise ValueError(
                f"{self.name}: block of {self.block} elements does not divide its {self.numel} "
                f"elements; pick a block that divides the tensor (for rows: a divisor of the row count times the row size)"
            )
        if self.shape is not None and math.prod(self.shape) != self.numel:
            raise ValueError(f"{self.name}: shape {self.shape} has {math.prod(self.shape)} elements, not {self.numel}")

    @property
    def row(self) -> int:
        """Elements of one leading-dim slice; 1 for 0/1-dim tensors and when ``shape`` is not given."""
        if self.shape is None or len(self.shape) < 2:
            return 1
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class Layout:
    """A bucket's flat buffer: where each tensor starts, and the per-rank shard size ``S``."""

    specs: tuple[TensorSpec, ...]  # in buffer order
    world_size: int
    shard_size: int
    offsets: dict[str, int]
    align: int = 1
    order: str = "given"
    _by_name: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {s.name: s for s in self.specs})

    # -- sizes --------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Elements of real tensor data (no padding)."""
        return sum(s.numel for s in self.specs)

    @property
    def global_size(self) -> int:
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        return self.global_size - self.numel

    @property
    def lower_bound(self) -> int:
        """The smallest ``S`` any layout could have: ``ceil(numel / m)`` rounded up to ``align``."""
        return _round_up(-(-self.numel // self.world_size), self.align)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def spec(self, name: str) -> TensorSpec:
        return self._by_name[name]

    # -- per-tensor geometry ------------------------------------------------------------------
    def global_range(self, name: str) -> tuple[int, int]:
        """``[start, end)`` of the tensor in the global buffer."""
        start = self.offsets[name]
        return start, start + self._by_name[name].numel

    def local_range(self, name: str, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s piece in the tensor's own flat elements (empty: ``start == end``)."""
        lo, hi = self.global_range(name)
        a = min(max(lo, rank * self.shard_size), hi)
        b = max(min(hi, (rank + 1) * self.shard_size), a)
        return a - lo, b - lo

    def shard_range(self, name: str, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s piece inside that rank's shard ``[0, S)``."""
        a, b = self.local_range(name, rank)
        base = self.offsets[name] - rank * self.shard_size
        if a == b:  # empty pieces sit at a clamped, valid offset
            pos = min(max(base + a, 0), self.shard_size)
            return pos, pos
        return base + a, base + b

    def placement(self, name: str) -> RaggedShard:
        """The tensor's :class:`RaggedShard` in this layout (block counts per rank)."""
        spec = self._by_name[name]
        block = max(spec.block, 1)
        lo, hi = self.global_range(name)
        if hi == lo:
            return RaggedShard.spanning(block, self.world_size, 0, ())
        # Only the ranks the tensor spans hold blocks: the placement costs its span, not the world size.
        first, last = lo // self.shard_size, (hi - 1) // self.shard_size
        span = []
        for r in range(first, last + 1):
            a, b = self.local_range(name, r)
            span.append((b - a) // block)
        return RaggedShard.spanning(block, self.world_size, first, span)

    def segments(self) -> list[tuple[str | None, int]]:
        """The global buffer as consecutive ``(name, size)`` pieces; ``None`` names padding."""
        out: list[tuple[str | None, int]] = []
        cursor = 0
        for s in sorted(self.specs, key=lambda s: (self.offsets[s.name], s.numel)):
            start = self.offsets[s.name]
            if start > cursor:
                out.append((None, start - cursor))
            out.append((s.name, s.numel))
            cursor = start + s.numel
        if self.global_size > cursor:
            out.append((None, self.global_size - cursor))
        return out

    # -- checks -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``AssertionError`` describing the first violated constraint."""
        S, m, a = self.shard_size, self.world_size, self.align
        assert S >= 0 and S % a == 0, f"shard size {S} is not a multiple of align={a}"
        spans = sorted(
            ((self.offsets[s.name], self.offsets[s.name] + s.numel, s) for s in self.specs), key=lambda t: t[:2]
        )
        cursor = 0
        for lo, hi, s in spans:
            assert lo % a == 0, f"{s.name} starts at {lo}, not a multiple of align={a}"
            assert lo >= cursor, f"{s.name} at [{lo}, {hi}) overlaps the previous tensor ending at {cursor}"
            assert hi <= m * S, f"{s.name} ends at {hi}, past the buffer of {m} x {S}"
            assert not count_cut_blocks(lo, s.numel, s.block, S), f"{s.name} has a block cut by a rank boundary"
            cursor = hi
        assert sum(self.placement(s.name).numel for s in self.specs) == self.numel

    def summary(self) -> str:
        """One line: ranks, S, padding and its fraction."""
        frac = self.padding / self.global_size if self.global_size else 0.0
        return (
            f"{len(self.specs)} tensors over {self.world_size} ranks: S={self.shard_size} "
            f"(lower bound {self.lower_bound}), padding {self.padding} ({frac:.2%}), order={self.order}"
        )


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def count_cut_blocks(start: int, numel: int, block: int, shard_size: int) -> int:
    """How many rank boundaries fall strictly inside ``[start, start+numel)`` off a block boundary."""
    if numel == 0 or shard_size == 0:
        return 0
    first = start // shard_size + 1
    last = (start + numel - 1) // shard_size
    if block == 1 or first > last:
        return 0
    if shard_size % block == 0:  # every boundary has the same phase
        return (last - first + 1) if (first * shard_size - start) % block else 0
    return sum(1 for k in range(first, last + 1) if (k * shard_size - start) % block)


# ---------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------


def _place(specs: Sequence[TensorSpec], S: int, m: int, align: int) -> dict[str, int] | None:
    """Greedy earliest-valid-start placement of ``specs`` in order, or None when ``S`` is infeasible.

    For a fixed order and ``S`` this is exact: a tensor's constraints depend only on its own start,
    and the earliest start leaves the most room for everything after it.
    """
    if S <= 0:
        return {s.name: 0 for s in specs} if all(s.numel == 0 for s in specs) else None
    end_of_buffer = m * S
    offsets: dict[str, int] = {}
    cursor = 0
    for s in specs:
        numel, block = s.numel, s.block
        cursor = -(-cursor // align) * align
        if numel == 0:
            if cursor > end_of_buffer:
                return None
            offsets[s.name] = cursor
            continue
        boundary = (cursor // S + 1) * S
        if cursor + numel <= boundary:  # fits in the current shard (the common case)
            start = cursor
        else:
            whole_shards_ok = S % block == 0
            if not whole_shards_ok and numel > 2 * S:
                return None
            step = block if align == 1 else math.lcm(block, align)
            lo = cursor
            while True:
                start = lo + (boundary - lo) % step
                if start < boundary and (start + numel <= boundary + S or whole_shards_ok):
                    break
                lo, boundary = boundary, boundary + S  # try the next shard
                if lo + numel <= boundary:
                    start = lo
                    break
                if boundary > end_of_buffer:
                    return None
        if start + numel > end_of_buffer:
            return None
        offsets[s.name] = start
        cursor = start + numel
    return offsets


_MAX_CANDIDATES = 256


def _candidate_alignments(specs: Sequence[TensorSpec], align: int, lower: int, limit: int) -> list[int]:
    """Values ``S < limit`` may have to be a multiple of, ascending.

    A tensor that contains a whole shard (two rank boundaries strictly inside it) forces ``S`` to be
    a multiple of its block; such a tensor has more than ``S >= lower`` elements, and one with more
    than ``2 * S`` elements always does. So every feasible ``S < limit`` is a multiple of
    ``lcm(align, blocks of the tensors above 2 * (limit - 1) elements, blocks of some subset of the
    other tensors above lower)``: the candidates are that LCM closure, pruned at ``limit``. Should
    the closure grow past ``_MAX_CANDIDATES`` (many distinct, mutually prime blocks), the running
    LCMs of the blocks (ascending block; descending tensor size) are added as well.
    """
    forced = align
    optional = set()
    for s in specs:
        if s.numel > 2 * (limit - 1):
            forced = math.lcm(forced, s.block)
        elif s.numel > lower:
            optional.add(math.lcm(s.block, align))
    if forced >= limit:
        return []
    found = {forced}
    complete = True
    for step in sorted(optional):
        found |= {g for g in (math.lcm(f, step) for f in found) if g < limit}
        if len(found) > _MAX_CANDIDATES:
            found = set(sorted(found)[:_MAX_CANDIDATES])
            complete = False
    if not complete:
        for seq in (sorted({s.block for s in specs}), [s.block for s in sorted(specs, key=lambda s: -s.numel)]):
            g = forced
            for b in seq:
                g = math.lcm(g, b)
                if g >= limit:
                    break
                found.add(g)
    return sorted(found)


def _trivial_shard(specs: Sequence[TensorSpec], m: int, align: int) -> int:
    """A shard size that is always feasible: a multiple of every block, with room to align each start."""
    steps = [math.lcm(s.block, align) for s in specs]
    lcm_all = math.lcm(align, *steps) if steps else align
    total = sum(s.numel for s in specs)
    return lcm_all * max(1, -(-(total + sum(steps)) // (m * lcm_all)))


def _smallest_multiple(specs: Sequence[TensorSpec], m: int, align: int, g: int, lower: int, below: int):
    """Smallest feasible multiple of ``g`` that is ``>= lower`` and ``< below``, with its offsets, or None.

    Galloping search up from the lower bound, then bisection: exact when feasibility is monotone
    over multiples of ``g`` (true when ``g`` is a multiple of the blocks of every tensor that
    contains a whole shard in the optimum), and always returns a feasible ``S`` when it returns one.
    """
    lo_k, hi_k = max(1, -(-lower // g)), (below - 1) // g
    if lo_k > hi_k:
        return None
    # Tensors that cannot fit in two shards must have S a multiple of their block: a cheap pre-check.
    large = [(s.numel, s.block) for s in specs if s.numel > 2 * lo_k * g and (g % s.block)]

    def place(k: int):
        S = k * g
        if any(numel > 2 * S and S % block for numel, block in large):
            return None
        return _place(specs, S, m, align)

    bad, k, jump = lo_k - 1, lo_k, 1
    while True:
        offsets = place(k)
        if offsets is not None:
            break
        bad = k
        if k == hi_k:
            return None
        k, jump = min(k + jump, hi_k), jump * 2
    good = k
    while good - bad > 1:
        mid = (good + bad) // 2
        trial = place(mid)
        if trial is None:
            bad = mid
        else:
            good, offsets = mid, trial
    return good * g, offsets


def _smallest_shard(
    specs: Sequence[TensorSpec], m: int, align: int, below: int | None = None
) -> tuple[int, dict[str, int]] | None:
    """Smallest feasible ``S`` (and the offsets) for ``specs`` in the given order.

    With ``below``, only an ``S < below`` is of interest: returns None when there is none.
    """
    total = sum(s.numel for s in specs)
    lower = max(_round_up(-(-total // m), align), align)
    if below is None:
        best_S = _trivial_shard(specs, m, align)
        best_offsets = _place(specs, best_S, m, align)
        assert best_offsets is not None, "the trivially feasible shard size failed; planner bug"
        best: tuple[int, dict[str, int]] | None = (best_S, best_offsets)
    else:
        best_S, best = below, None
    for g in _candidate_alignments(specs, align, lower, best_S):
        if best_S <= lower or g >= best_S:
            break
        found = _smallest_multiple(specs, m, align, g, lower, best_S)
        if found is not None:
            best = found
            best_S = found[0]
    return best


_ORDERS = {
    "given": lambda specs: list(specs),
    "by_block": lambda specs: sorted(specs, key=lambda s: -s.block),
    "by_size": lambda specs: sorted(specs, key=lambda s: -s.numel),
    "by_block_ascending": lambda specs: sorted(specs, key=lambda s: s.block),
    "by_size_ascending": lambda specs: sorted(specs, key=lambda s: s.numel),
}


def plan(specs: Iterable[TensorSpec], world_size: int, align: int = 8, orders: Sequence[str] = tuple(_ORDERS)) -> Layout:
    """Pack ``specs`` into one buffer of ``world_size * S`` elements with the smallest ``S`` found.

    Args:
        specs: the tensors of one bucket, in first-use order (names must be unique).
        world_size: ranks the buffer is sharded over (``m``).
        align: tensor starts and ``S`` are multiples of this many elements (8 = 16 bytes of bf16).
        orders: which tensor orders to try (``"given"``, ``"by_block"``, ``"by_size"``, and the
            ``*_ascending`` variants; sorts are stable and descending by default); ties keep
            the earlier order, so the given order wins unless another is strictly better.

    For each order the smallest feasible ``S`` *for that order* is found exactly (see
    :func:`_candidate_alignments`); the search stops early once ``S`` reaches the lower bound.
    ``S`` is at least ``align``, even for a bucket of empty tensors.
    """
    specs = list(specs)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1 element, got {align}")
    unknown = [o for o in orders if o not in _ORDERS]
    if unknown or not orders:
        raise ValueError(f"unknown tensor orders {unknown}; choose from {list(_ORDERS)}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensor names must be unique within a bucket; repeated: {dup}")
    lower = max(_round_up(-(-sum(s.numel for s in specs) // world_size), align), align)
    best: Layout | None = None
    tried: set[tuple[str, ...]] = set()
    for order in orders:
        ordered = _ORDERS[order](specs)
        key = tuple(s.name for s in ordered)
        if key in tried:  # the same sequence as an earlier order: same answer
            continue
        tried.add(key)
        found = _smallest_shard(ordered, world_size, align, None if best is None else best.shard_size)
        if found is not None:
            best = Layout(tuple(ordered), world_size, found[0], found[1], align, order)
        if best.shard_size <= lower:
            break
    assert best is not None
    return best


_MAX_PEELS = 4


def plan_buckets(
    specs: Iterable[TensorSpec],
    world_size: int,
    align: int = 8,
    max_bucket_numel: int | None = None,
    padding_tolerance: float = 0.001,
) -> list[Layout]:
    """Split one unit's tensors into buckets so that mixed block sizes do not inflate padding.

    A tensor that spans several shards forces its bucket's ``S`` to be a multiple of its block, so
    one large tensor with an unusual block (16 rows of 16384 next to 16 rows of 6144, say) rounds
    ``S`` up to the LCM of the blocks on every rank. Three groupings are planned and the one with the
    least total padding wins (ties: fewer buckets; the whole unit first):

    1. **whole** — the unit as one bucket (returned at once when it pads at most
       ``padding_tolerance`` of the unit's elements);
    2. **peel** — starting from the whole unit, the tensors that must span whole shards (more than
       twice the per-rank share) are grouped by block; the group whose removal into its own bucket
       saves the most padding is peeled off, and this repeats (up to four times) while it helps;
       peeled groups are then merged while merging pads no more (plus ``padding_tolerance``);
    3. **block groups** — tensors with equal blocks together (in first-use order), merged back in
       order whenever the merged bucket pads no more than the two apart plus ``padding_tolerance``.

    The result never pads more than ``plan(specs)`` when the whole unit fits ``max_bucket_numel``.
    Every bucket holds at most ``max_bucket_numel`` elements unless it is a single larger tensor.
    Buckets come back ordered by their first tensor in ``specs``.
    """
    specs = list(specs)
    if not specs:
        return []
    m, limit = world_size, max_bucket_numel
    total = sum(s.numel for s in specs)
    options: list[list[Layout]] = []
    if _fits(total, limit):
        whole = plan(specs, m, align)
        if whole.padding <= padding_tolerance * total:
            return [whole]
        options.append([whole])
        peeled = _peel(specs, whole, limit, padding_tolerance)
        if peeled is not None:
            options.append(peeled)
    options.append(_block_groups(specs, m, align, limit, padding_tolerance))
    return min(options, key=lambda buckets: (sum(b.padding for b in buckets), len(buckets)))


def _peel(specs: list[TensorSpec], whole: Layout, limit: int | None, tolerance: float) -> list[Layout] | None:
    """Grouping 2 of :func:`plan_buckets`; None when no peel helps."""
    m, align = whole.world_size, whole.align
    index = {s.name: i for i, s in enumerate(specs)}
    main, peeled = whole, []
    for _ in range(_MAX_PEELS):
        share = -(-main.numel // m)
        by_step: dict[int, list[TensorSpec]] = {}
        for s in main.specs:
            if s.numel > 2 * share:
                by_step.setdefault(math.lcm(s.block, align), []).append(s)
        best: tuple[int, Layout, Layout] | None = None
        for group in by_step.values():
            names = {s.name for s in group}
            rest = sorted((s for s in main.specs if s.name not in names), key=lambda s: index[s.name])
            if not rest:
                continue
            kept, out = plan(rest, m, align), plan(sorted(group, key=lambda s: index[s.name]), m, align)
            if best is None or kept.padding + out.padding < best[0]:
                best = (kept.padding + out.padding, kept, out)
        if best is None or best[0] >= main.padding:
            break
        main = best[1]
        peeled.append(best[2])
    if not peeled:
        return None
    buckets = [main, *peeled]
    merged = True
    while merged and len(buckets) > 2:  # peeled groups may share a bucket without padding more
        merged = False
        for i, j in itertools.combinations(range(1, len(buckets)), 2):
            if not _fits(buckets[i].numel + buckets[j].numel, limit):
                continue
            both = plan(sorted(buckets[i].specs + buckets[j].specs, key=lambda s: index[s.name]), m, align)
            if both.padding <= buckets[i].padding + buckets[j].padding + tolerance * both.numel:
                buckets[i] = both
                del buckets[j]
                merged = True
                break
    return sorted(buckets, key=lambda b: min(index[n] for n in b.names))


def _block_groups(
    specs: list[TensorSpec], m: int, align: int, limit: int | None, tolerance: float
) -> list[Layout]:
    """Grouping 3 of :func:`plan_buckets`."""
    groups: dict[int, list[TensorSpec]] = {}
    for s in specs:
        groups.setdefault(s.block, []).append(s)
    pieces: list[list[TensorSpec]] = []
    for group in groups.values():
        pieces.extend(_chunk(group, limit))
    buckets: list[Layout] = []
    for piece in pieces:
        layout = plan(piece, m, align)
        if buckets and _fits(buckets[-1].numel + layout.numel, limit):
            merged = plan(list(buckets[-1].specs) + piece, m, align)
            if merged.padding <= buckets[-1].padding + layout.padding + tolerance * merged.numel:
                buckets[-1] = merged
                continue
        buckets.append(layout)
    return buckets


def _fits(numel: int, limit: int | None) -> bool:
    return limit is None or numel <= limit


def _chunk(group: list[TensorSpec], limit: int | None) -> list[list[TensorSpec]]:
    out: list[list[TensorSpec]] = [[]]
    size = 0
    for s in group:
        if out[-1] and not _fits(size + s.numel, limit):
            out.append([])
            size = 0
        out[-1].append(s)
        size += s.numel
    return out
