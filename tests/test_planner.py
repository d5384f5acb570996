"""The structure-aware planner: constraints, optimality against brute force, buckets; the benchmarks' baselines."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_pass.planner import Layout, TensorSpec, plan, plan_buckets

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from baselines import fsdp2_shard0, naive_concat, rowwise_concat  # noqa: E402  (the comparison baselines)

TOY = [TensorSpec("t1", 12, 4), TensorSpec("t2", 10, 2), TensorSpec("t3", 6, 3), TensorSpec("t4", 3, 1)]


# ---------------------------------------------------------------------------------------------
# Strategies and independent checkers (no planner code reused)
# ---------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def tensor_sets(draw, max_tensors: int = 30, max_dim: int = 48):
    """1-30 tensors: element, row, k-row and whole-tensor blocks, empty tensors, random multiples."""
    specs = []
    for i in range(draw(st.integers(1, max_tensors))):
        kind = draw(st.sampled_from(["element", "row", "rows", "whole", "empty", "multiple"]))
        rows, row = draw(st.integers(1, max_dim)), draw(st.integers(1, max_dim))
        shape: tuple[int, ...] | None = (rows, row)
        if kind == "element":
            block = 1
        elif kind == "row":
            block = row
        elif kind == "rows":
            block = draw(st.sampled_from(_divisors(rows))) * row
        elif kind == "whole":
            block = rows * row
        elif kind == "empty":
            shape, block = (0, row), draw(st.integers(1, 16))
        else:
            block = draw(st.integers(1, 64))
            shape = (block * draw(st.integers(0, 40)),)
        specs.append(TensorSpec(f"t{i}", math.prod(shape), block, shape))
    return specs


world_sizes = st.one_of(st.integers(1, 16), st.sampled_from([2**k for k in range(13)]), st.integers(1, 4096))
aligns = st.sampled_from([1, 4, 8])


def _trivial_shard(specs, m, align):
    """S_triv = L * ceil((E + sum lcm(g_t, align)) / (m L)), L = lcm(align, every lcm(g_t, align))."""
    steps = [math.lcm(s.block, align) for s in specs]
    L = math.lcm(align, *steps)
    return L * -(-(sum(s.numel for s in specs) + sum(steps)) // (m * L))


def _placement_ok(starts, specs, S, m, align) -> bool:
    """The planner's constraints, checked element by element (tiny sizes only)."""
    if S % align:
        return False
    cursor = 0
    for start, s in sorted(zip(starts, specs), key=lambda p: (p[0], p[1].numel)):
        if start % align or start < cursor or start + s.numel > m * S:
            return False
        if any(start < k * S < start + s.numel and (k * S - start) % s.block for k in range(1, m)):
            return False
        cursor = start + s.numel
    return True


def _feasible_in_order(specs, S, m, align) -> bool:
    """Exhaustive search over every aligned start of every tensor, in the given order."""

    def dfs(i: int, cursor: int) -> bool:
        if i == len(specs):
            return True
        s = specs[i]
        start = -(-cursor // align) * align
        while start + s.numel <= m * S:
            if not any(start < k * S < start + s.numel and (k * S - start) % s.block for k in range(1, m)):
                if dfs(i + 1, start + s.numel):
                    return True
            start += align
        return False

    return dfs(0, 0)


def _brute_shard(specs, m, align) -> int:
    """Smallest S (a multiple of align, at least align) with a valid placement in this order."""
    E = sum(s.numel for s in specs)
    S = max(-(-(-(-E // m)) // align) * align, align)
    while not _feasible_in_order(specs, S, m, align):
        S += align
    return S


def _check_layout(layout: Layout, specs) -> None:
    """Everything a layout promises, checked from the outside."""
    layout.validate()
    m, S = layout.world_size, layout.shard_size
    assert sorted(layout.names) == sorted(s.name for s in specs)
    assert S >= layout.lower_bound and S % layout.align == 0
    # every rank boundary inside a tensor falls on one of its block boundaries
    for s in specs:
        lo = layout.offsets[s.name]
        assert lo % layout.align == 0
        for k in range(lo // S + 1, (lo + s.numel - 1) // S + 1 if s.numel else 0):
            assert (k * S - lo) % s.block == 0, f"{s.name} cut at rank boundary {k}"
    # segments tile the buffer
    segs = layout.segments()
    assert sum(size for _, size in segs) == m * S
    assert [n for n, _ in segs if n is not None] == sorted(layout.names, key=lambda n: (layout.offsets[n], layout.spec(n).numel))
    pos = 0
    for name, size in segs:
        if name is None:
            assert size > 0
        else:
            assert layout.offsets[name] == pos and size == layout.spec(name).numel
        pos += size
    assert sum(size for name, size in segs if name is None) == layout.padding
    # placements: units sum to numel / block and the local ranges tile each tensor
    for s in specs:
        p = layout.placement(s.name)
        assert p.block == s.block and p.world_size == m
        assert p.num_blocks == s.numel // s.block
        if s.shape is not None:
            p.validate(s.shape, m, s.name)
        ranges = p.ranges()
        lo = layout.offsets[s.name]
        touched = range(lo // S, (lo + s.numel - 1) // S + 1) if s.numel else range(0)
        assert sum(ranges[r][1] - ranges[r][0] for r in touched) == s.numel  # other ranks hold nothing
        for r in touched:  # the piece sits inside rank r's shard at the offset shard_range says
            a, b = layout.local_range(s.name, r)
            assert (a, b) == ranges[r] and b > a
            sa, sb = layout.shard_range(s.name, r)
            assert sb - sa == b - a and 0 <= sa and sb <= S
            assert r * S + sa == lo + a


# ---------------------------------------------------------------------------------------------
# Known examples
# ---------------------------------------------------------------------------------------------


def test_toy_example_from_the_paper_notes():
    layout = plan(TOY, 3, align=1, orders=["given"])
    layout.validate()
    assert layout.shard_size == 12
    assert layout.offsets == {"t1": 0, "t2": 12, "t3": 24, "t4": 30}
    assert layout.segments() == [("t1", 12), ("t2", 10), (None, 2), ("t3", 6), ("t4", 3), (None, 3)]
    assert layout.padding == 5 and layout.lower_bound == 11
    assert [layout.placement(n).local_units for n in ("t1", "t2", "t3", "t4")] == [
        (3, 0, 0), (0, 5, 0), (0, 0, 2), (0, 0, 3)
    ]
    assert layout.shard_range("t4", 2) == (6, 9) and layout.shard_range("t1", 1) == (0, 0)
    assert layout.global_range("t2") == (12, 22) and layout.local_range("t2", 1) == (0, 10)


def test_toy_example_permuted_order_and_more_ranks():
    permuted = [TOY[3], TOY[0], TOY[1], TOY[2]]  # (t4, t1, t2, t3): S = 11 at m = 3
    layout = plan(permuted, 3, align=1, orders=["given"])
    assert layout.shard_size == 11 == _brute_shard(permuted, 3, 1)
    assert layout.offsets == {"t4": 0, "t1": 3, "t2": 16, "t3": 26}
    assert layout.placement("t1").local_units == (2, 1, 0)
    four = plan(TOY, 4, align=1, orders=["given"])
    assert four.shard_size == 9 == _brute_shard(TOY, 4, 1)
    _check_layout(four, TOY)


def _layout(S, m, offsets, specs=TOY, align=1):
    return Layout(tuple(specs), m, S, offsets, align)


@pytest.mark.parametrize(
    "S, offsets, align, fragment",
    [
        (12, {"t1": 0, "t2": 10, "t3": 24, "t4": 30}, 1, "t2 at [10, 20) overlaps the previous tensor ending at 12"),
        (12, {"t1": 2, "t2": 14, "t3": 24, "t4": 30}, 1, "t1 has a block cut by a rank boundary"),
        (12, {"t1": 0, "t2": 12, "t3": 24, "t4": 34}, 1, "t4 ends at 37, past the buffer of 3 x 12"),
        (12, {"t1": 0, "t2": 12, "t3": 24, "t4": 30}, 4, "t4 starts at 30, not a multiple of align=4"),
        (10, {"t1": 0, "t2": 12, "t3": 24, "t4": 30}, 4, "shard size 10 is not a multiple of align=4"),
    ],
)
def test_validate_reports_each_violated_constraint(S, offsets, align, fragment):
    with pytest.raises(AssertionError, match=fragment.replace("[", r"\[").replace(")", r"\)")):
        _layout(S, 3, offsets, align=align).validate()


def test_validate_handles_several_empty_tensors_at_one_offset():
    specs = [TensorSpec("a", 0, 1), TensorSpec("b", 0, 4), TensorSpec("c", 8, 1)]
    layout = plan(specs, 2, align=8)
    _check_layout(layout, specs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(world_size=0), "world_size must be >= 1"),
        (dict(align=0), "align must be >= 1 element"),
        (dict(orders=["sideways"]), "unknown tensor orders"),
        (dict(specs=[TensorSpec("a", 4), TensorSpec("a", 8)]), r"repeated: \['a'\]"),
    ],
)
def test_plan_rejects_bad_arguments(kwargs, fragment):
    args = dict(specs=TOY, world_size=2, align=1) | kwargs
    with pytest.raises(ValueError, match=fragment):
        plan(args.pop("specs"), **args)


def test_tensor_spec_validation_names_the_tensor():
    with pytest.raises(ValueError, match="w: block of 3 elements does not divide its 10 elements"):
        TensorSpec("w", 10, 3)
    with pytest.raises(ValueError, match=r"w: shape \(2, 4\) has 8 elements, not 10"):
        TensorSpec("w", 10, 1, (2, 4))
    assert TensorSpec("w", 8, 1, (2, 4)).row == 4 and TensorSpec("b", 4, 1, (4,)).row == 1


# ---------------------------------------------------------------------------------------------
# Properties over random tensor sets
# ---------------------------------------------------------------------------------------------


@given(tensor_sets(), world_sizes, aligns)
@settings(max_examples=100, deadline=None)
def test_plan_properties(specs, m, align):
    layout = plan(specs, m, align)
    _check_layout(layout, specs)
    assert layout.shard_size >= max(-(-sum(s.numel for s in specs) // m), 1)
    assert layout.shard_size <= _trivial_shard(specs, m, align)
    again = plan(specs, m, align)
    assert (again.shard_size, again.offsets, again.order, again.names) == (
        layout.shard_size, layout.offsets, layout.order, layout.names
    )


@given(tensor_sets(), world_sizes, aligns, st.sampled_from(["given", "by_block", "by_size"]))
@settings(max_examples=60, deadline=None)
def test_every_single_order_is_valid_and_no_better_than_all_orders(specs, m, align, order):
    one = plan(specs, m, align, orders=[order])
    _check_layout(one, specs)
    assert plan(specs, m, align).shard_size <= one.shard_size


@st.composite
def tiny_sets(draw):
    n = draw(st.integers(1, 4))
    specs = []
    for i in range(n):
        block = draw(st.sampled_from([1, 2, 3, 4, 5, 6]))
        specs.append(TensorSpec(f"t{i}", block * draw(st.integers(0, 4)), block))
    return specs


@given(tiny_sets(), st.integers(1, 4), st.sampled_from([1, 2, 4]))
@settings(max_examples=150, deadline=None)
def test_fixed_order_shard_size_is_exactly_optimal(specs, m, align):
    """For one order, the smallest feasible S found by exhaustive search over starts."""
    assert plan(specs, m, align, orders=["given"]).shard_size == _brute_shard(specs, m, align)


@given(tiny_sets(), st.integers(1, 4), st.sampled_from([1, 2, 4]))
@settings(max_examples=100, deadline=None, derandomize=True)
def test_plan_is_near_the_optimum_over_all_permutations(specs, m, align):
    """Five orders are not every order; on tiny sets the result stays within 2x of the best permutation."""
    best = min(_brute_shard(list(p), m, align) for p in itertools.permutations(specs))
    layout = plan(specs, m, align)
    assert best <= layout.shard_size <= 2 * best
    assert _placement_ok([layout.offsets[s.name] for s in specs], specs, layout.shard_size, m, align)


# ---------------------------------------------------------------------------------------------
# plan_buckets
# ---------------------------------------------------------------------------------------------


@given(tensor_sets(), world_sizes, aligns, st.one_of(st.none(), st.integers(1, 20000)))
@settings(max_examples=50, deadline=None)
def test_plan_buckets_properties(specs, m, align, limit):
    buckets = plan_buckets(specs, m, align, max_bucket_numel=limit)
    names = [n for b in buckets for n in b.names]
    assert sorted(names) == sorted(s.name for s in specs), "every tensor exactly once"
    by_name = {s.name: s for s in specs}
    for b in buckets:
        _check_layout(b, [by_name[n] for n in b.names])
        assert limit is None or b.numel <= limit or len(b.specs) == 1
    if limit is None:
        assert sum(b.padding for b in buckets) <= plan(specs, m, align).padding


def _mixed_rows(k: int = 16):
    """Attention-like (row 6144) and FFN-down-like (row 16384) matrices, blocks of k rows."""
    shapes = {"wq": (6144, 6144), "wk": (1024, 6144), "wv": (1024, 6144), "wo": (6144, 6144),
              "w1": (16384, 6144), "w3": (16384, 6144), "w2": (6144, 16384)}
    return [TensorSpec(n, math.prod(s), k * s[1], s) for n, s in shapes.items()]


@pytest.mark.parametrize("m", [128, 1024, 2048])
def test_plan_buckets_beats_one_bucket_when_row_blocks_have_a_large_lcm(m):
    specs = _mixed_rows()
    one = plan(specs, m)
    buckets = plan_buckets(specs, m)
    assert len(buckets) > 1
    assert sum(b.padding for b in buckets) < one.padding
    for b in buckets:
        b.validate()


def test_plan_buckets_keeps_one_bucket_when_it_is_best():
    specs = [TensorSpec(f"w{i}", 64 * 64, 64, (64, 64)) for i in range(8)]
    (only,) = plan_buckets(specs, 8)
    assert only.padding == 0 and sorted(only.names) == sorted(s.name for s in specs)
    assert plan_buckets([], 8) == []


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def test_naive_concat_cuts_blocks():
    specs = [TensorSpec("a", 2, 2), TensorSpec("b", 8, 4)]
    naive = naive_concat(specs, 2)  # S = 5: b = [2, 10) is cut at 5, 3 elements into a 4-block
    assert (naive.shard_size, naive.padding, naive.blocks_cut) == (5, 0, 1)
    assert naive_concat(specs, 2, align=4).shard_size == 8
    planned = plan(specs, 2, align=1)
    planned.validate()  # the planner pads instead of cutting
    assert planned.padding > 0


def test_fsdp2_shard0_rounds_each_parameter_to_whole_row_chunks():
    specs = [
        TensorSpec("w", 40, 8, (10, 4)),  # ceil(10/4)=3 rows of 4 -> 12; blocks of 2 rows cut at 12 and 36
        TensorSpec("b", 3, 1, (3,)),  # ceil(3/4)=1 element -> 1
        TensorSpec("e", 28, 4, (7, 2, 2)),  # ceil(7/4)=2 slices of 4 -> 8
        TensorSpec("x", 8, 4, (2, 4)),  # ceil(2/4)=1 row -> 4: two ranks hold only padding
    ]
    base = fsdp2_shard0(specs, 4)
    assert base.shard_size == 12 + 1 + 8 + 4
    assert base.padding == 4 * 25 - (40 + 3 + 28 + 8) == 21
    assert base.blocks_cut == 2


@given(tensor_sets(), world_sizes)
@settings(max_examples=60, deadline=None)
def test_fsdp2_shard0_padding_matches_per_parameter_rounding(specs, m):
    base = fsdp2_shard0(specs, m)
    expected = 0
    for s in specs:
        shape = s.shape or (s.numel,)
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        expected += -(-shape[0] // m) * row
    assert base.shard_size == expected
    assert base.padding == m * expected - sum(s.numel for s in specs)


@given(tensor_sets(), world_sizes, aligns)
@settings(max_examples=60, deadline=None)
def test_rowwise_concat_never_cuts_rows(specs, m, align):
    rows = [TensorSpec(s.name, s.numel, s.row if s.numel else 1, s.shape) for s in specs]
    base = rowwise_concat(rows, m, align)
    assert base.blocks_cut == 0
    assert base.shard_size >= -(-base.numel // m) and base.shard_size % align == 0


def test_rowwise_concat_cuts_multi_row_blocks():
    specs = [TensorSpec("a", 8, 4, (2, 4)), TensorSpec("b", 16, 8, (4, 4))]
    base = rowwise_concat(specs, 2, align=1)  # S = 12: boundary 12 is row 1 of b, inside a 2-row block
    assert (base.shard_size, base.padding, base.blocks_cut) == (12, 0, 1)
    planned = plan(specs, 2, align=1)
    _check_layout(planned, specs)
    assert planned.padding > 0
