"""RaggedShard layout math: ranges, validation, views, checkpoint boxes, redistribution splits."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_pass.placement import RaggedShard, flat_range_boxes, local_view_shape, numel_of, transfer_splits

FAST = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------------------------------------
# RaggedShard
# ---------------------------------------------------------------------------------------------


def test_local_range_and_ranges_follow_the_docstring_example():
    p = RaggedShard(block=4, local_units=(2, 0, 3))
    assert p.world_size == 3 and p.num_blocks == 5 and p.numel == 20
    assert [p.local_range(r) for r in range(3)] == [(0, 8), (8, 8), (8, 20)]
    assert p.ranges() == [(0, 8), (8, 8), (8, 20)]
    assert [p.local_numel(r) for r in range(3)] == [8, 0, 12]


def test_local_range_rejects_a_rank_outside_the_mesh():
    p = RaggedShard(1, (1, 1))
    for rank in (-1, 2):
        with pytest.raises(ValueError, match=f"rank {rank} is outside a RaggedShard of 2 ranks"):
            p.local_range(rank)


@given(st.integers(1, 7), st.lists(st.integers(0, 5), min_size=1, max_size=8))
@FAST
def test_ranges_tile_the_flat_tensor(block, units):
    p = RaggedShard(block, tuple(units))
    ranges = p.ranges()
    assert ranges == [p.local_range(r) for r in range(len(units))]
    assert ranges[0][0] == 0 and ranges[-1][1] == p.numel == block * sum(units)
    for (a, b), (c, d), u in zip(ranges, ranges[1:] + [(p.numel, p.numel)], units):
        assert b == c and b - a == u * block


@pytest.mark.parametrize(
    "block, units, fragment",
    [
        (0, (1,), "block must be >= 1 element, got 0"),
        (2, (), "needs one entry of local_units per rank"),
        (2, (1, -1), "local_units must be >= 0"),
    ],
)
def test_constructor_rejects_malformed_placements(block, units, fragment):
    with pytest.raises(ValueError, match=fragment):
        RaggedShard(block, units)


def test_validate_accepts_a_matching_shape():
    RaggedShard(8, (1, 0, 2)).validate((6, 4), 3, name="w")
    RaggedShard(1, (0, 0)).validate((0, 4), 2, name="empty")


def test_validate_block_not_dividing_names_the_tensor_and_the_fix():
    with pytest.raises(ValueError) as err:
        RaggedShard(7, (1, 1)).validate((4, 5), 2, name="layers.0.wq")
    msg = str(err.value)
    assert msg.startswith("layers.0.wq:")
    assert "block of 7 elements does not divide shape (4, 5) (20 elements)" in msg
    assert "choose a block that divides the element count" in msg


def test_validate_wrong_number_of_units_names_the_tensor_and_the_fix():
    with pytest.raises(ValueError) as err:
        RaggedShard(4, (1, 2, 2)).validate((4, 5), 4, name="emb")
    msg = str(err.value)
    assert msg.startswith("emb:")
    assert "3 local_units entries but the mesh has 4 ranks" in msg
    assert "give exactly one block count per rank (zeros allowed)" in msg


def test_validate_wrong_sum_names_the_tensor_and_the_fix():
    with pytest.raises(ValueError) as err:
        RaggedShard(4, (1, 2, 1)).validate((4, 5), 3, name="head")
    msg = str(err.value)
    assert msg.startswith("head:")
    assert "local_units (1, 2, 1) sum to 4 blocks" in msg
    assert "has 5 blocks of 4 elements; make the units sum to 5" in msg


def test_equality_and_hash_are_by_value():
    a, b = RaggedShard(4, (1, 2)), RaggedShard(4, [1, 2])  # a list is normalised to a tuple
    assert a == b and hash(a) == hash(b) and b.local_units == (1, 2)
    assert len({a, b, RaggedShard(4, (2, 1)), RaggedShard(2, (1, 2))}) == 3
    assert a != RaggedShard(4, (2, 1)) and a != RaggedShard(2, (1, 2))
    with pytest.raises(AttributeError):
        a.block = 8  # frozen


def test_repr_shows_block_and_units():
    assert repr(RaggedShard(128, (3, 0, 1))) == "RaggedShard(block=128, local_units=[3, 0, 1])"
    many = RaggedShard(1, (4,) * 1020 + (2, 0, 0, 0))
    assert repr(many) == "RaggedShard(block=1, local_units=[4x1020, 2, 0x3] over 1024 ranks)"


@pytest.mark.parametrize(
    "numel, world, block, units",
    [(10, 3, 2, (2, 2, 1)), (12, 4, 3, (1, 1, 1, 1)), (6, 4, 3, (1, 1, 0, 0)), (0, 2, 1, (0, 0)), (7, 1, 1, (7,))],
)
def test_even_spreads_blocks_first_ranks_first(numel, world, block, units):
    p = RaggedShard.even(numel, world, block)
    assert p == RaggedShard(block, units)
    assert p.numel == numel


def test_even_rejects_a_block_that_does_not_divide():
    with pytest.raises(ValueError, match="block of 4 elements does not divide 10 elements"):
        RaggedShard.even(10, 2, block=4)


def test_on_root_puts_everything_on_one_rank():
    p = RaggedShard.on_root(24, 4, root=2)
    assert p == RaggedShard(24, (0, 0, 1, 0))
    assert p.local_range(2) == (0, 24) and p.local_range(3) == (24, 24)
    assert RaggedShard.on_root(24, 4, root=1, block=6) == RaggedShard(6, (0, 4, 0, 0))
    empty = RaggedShard.on_root(0, 3, root=0)
    assert empty.numel == 0 and empty.world_size == 3
    empty.validate((0,), 3)
    with pytest.raises(ValueError, match="root 4 is outside the 4 ranks"):
        RaggedShard.on_root(24, 4, root=4)


# ---------------------------------------------------------------------------------------------
# local_view_shape
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, start, end, expected",
    [
        ((6, 4), 4, 12, (2, 4)),  # whole rows
        ((6, 4), 2, 6, (4,)),  # cut inside a row
        ((6, 4), 0, 24, (6, 4)),
        ((6, 4), 8, 8, (0, 4)),  # empty, 2-D
        ((5,), 1, 4, (3,)),
        ((5,), 2, 2, (0,)),
        ((2, 3, 4), 0, 12, (1, 3, 4)),  # one leading slice
        ((2, 3, 4), 4, 12, (2, 4)),  # rows of the inner matrix
        ((2, 3, 4), 5, 7, (2,)),
        ((), 0, 1, (1,)),
    ],
)
def test_local_view_shape_examples(shape, start, end, expected):
    assert local_view_shape(shape, start, end) == expected


def test_local_shape_uses_the_rank_range():
    p = RaggedShard(4, (1, 2, 0, 3))
    assert [p.local_shape((6, 4), r) for r in range(4)] == [(1, 4), (2, 4), (0, 4), (3, 4)]
    assert RaggedShard(1, (5, 19)).local_shape((6, 4), 0) == (5,)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
@FAST
def test_local_view_shape_has_the_range_size_and_a_suffix_of_the_shape(shape, data):
    n = numel_of(shape)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    view = local_view_shape(shape, start, end)
    assert math.prod(view) == end - start
    if end > start:
        trailing = view[1:]
        assert tuple(shape[len(shape) - len(trailing):]) == trailing
        assert start % numel_of(trailing) == 0 and end % numel_of(trailing) == 0


# ---------------------------------------------------------------------------------------------
# flat_range_boxes
# ---------------------------------------------------------------------------------------------


def _box_indices(shape, box):
    offsets, sizes = box
    strides = [numel_of(shape[i + 1:]) for i in range(len(shape))]
    ranges = [range(o, o + s) for o, s in zip(offsets, sizes)]
    return [sum(i * w for i, w in zip(idx, strides)) for idx in itertools.product(*ranges)]


def _check_boxes(shape, start, end):
    boxes = flat_range_boxes(shape, start, end)
    seen: list[int] = []
    for offsets, sizes in boxes:
        assert len(offsets) == len(sizes) == len(shape)
        assert all(s >= 1 for s in sizes), "empty box"
        assert all(0 <= o and o + s <= d for o, s, d in zip(offsets, sizes, shape)), "box out of bounds"
        seen += _box_indices(shape, (offsets, sizes))
    assert len(seen) == len(set(seen)), "boxes overlap"
    assert set(seen) == set(range(start, end)), "boxes do not cover exactly the range"
    assert len(boxes) <= max(2 * len(shape) - 1, 0 if start == end else 1)
    return boxes


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
@settings(max_examples=300, deadline=None)
def test_flat_range_boxes_cover_the_range_exactly(shape, data):
    n = numel_of(shape)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    _check_boxes(tuple(shape), start, end)


@pytest.mark.parametrize(
    "shape, most", [((1,), 1), ((5,), 1), ((2, 3), 2), ((3, 4), 3), ((4, 4), 3), ((4, 1), 1), ((1, 4), 1)]
)
def test_flat_range_boxes_brute_force_every_range(shape, most):
    """Every range of a tiny 1-D/2-D tensor; the worst case is 1 box in 1-D and 3 in 2-D."""
    n = numel_of(shape)
    counts = [len(_check_boxes(shape, a, b)) for a in range(n + 1) for b in range(a, n + 1)]
    assert max(counts) == most


def test_flat_range_boxes_known_2d_case():
    # rows of 4: [3, 13) = tail of row 0, rows 1-2, head of row 3
    assert flat_range_boxes((4, 4), 3, 13) == [((0, 3), (1, 1)), ((1, 0), (2, 4)), ((3, 0), (1, 1))]
    assert flat_range_boxes((4, 4), 4, 12) == [((1, 0), (2, 4))]
    assert flat_range_boxes((4, 4), 5, 5) == []
    assert flat_range_boxes((), 0, 1) == [((), ())]


# ---------------------------------------------------------------------------------------------
# transfer_splits: simulate the all-to-all with Python lists
# ---------------------------------------------------------------------------------------------


def _simulate(src: RaggedShard, dst: RaggedShard) -> list[list[int]]:
    data = list(range(src.numel))
    m = src.world_size
    local = [data[a:b] for a, b in src.ranges()]
    splits = [transfer_splits(src, dst, r) for r in range(m)]
    inbox: list[list[list[int]]] = [[[] for _ in range(m)] for _ in range(m)]  # inbox[dst][src]
    for r in range(m):
        send, _ = splits[r]
        assert sum(send) == len(local[r])
        pos = 0
        for q in range(m):  # consecutive pieces in peer order: the all_to_all_single contract
            inbox[q][r] = local[r][pos:pos + send[q]]
            pos += send[q]
    out = []
    for q in range(m):
        _, recv = splits[q]
        assert [len(piece) for piece in inbox[q]] == recv
        out.append([x for piece in inbox[q] for x in piece])
    return out


@st.composite
def _two_placements(draw):
    m = draw(st.integers(1, 6))
    numel = draw(st.integers(0, 60))
    divisors = [d for d in range(1, max(numel, 1) + 1) if numel % d == 0] if numel else [1, 2, 3]

    def one():
        block = draw(st.sampled_from(divisors))
        blocks = numel // block
        cuts = sorted(draw(st.lists(st.integers(0, blocks), min_size=m - 1, max_size=m - 1)))
        bounds = [0, *cuts, blocks]
        return RaggedShard(block, tuple(b - a for a, b in zip(bounds, bounds[1:])))

    return one(), one()


@given(_two_placements())
@settings(max_examples=200, deadline=None)
def test_transfer_splits_move_every_element_to_its_new_owner(pair):
    src, dst = pair
    got = _simulate(src, dst)
    data = list(range(dst.numel))
    assert got == [data[a:b] for a, b in dst.ranges()]
    for r in range(src.world_size):  # what r sends to q is what q receives from r
        for q in range(src.world_size):
            assert transfer_splits(src, dst, r)[0][q] == transfer_splits(src, dst, q)[1][r]


def test_transfer_splits_example_from_the_notes():
    src, dst = RaggedShard(4, (1, 2, 0, 3)), RaggedShard(6, (1, 1, 1, 1))
    assert transfer_splits(src, dst, 1) == ([2, 6, 0, 0], [0, 6, 0, 0])
    assert transfer_splits(src, dst, 2) == ([0, 0, 0, 0], [0, 0, 0, 6])
    assert transfer_splits(src, dst, 3) == ([0, 0, 6, 6], [0, 0, 0, 6])


def test_transfer_splits_rejects_mismatched_layouts():
    with pytest.raises(ValueError, match="same element count"):
        transfer_splits(RaggedShard(1, (2, 2)), RaggedShard(1, (2, 3)), 0)
    with pytest.raises(ValueError, match="same number of ranks"):
        transfer_splits(RaggedShard(1, (2, 2)), RaggedShard(1, (2, 1, 1)), 0)


def test_sub_range_keeps_each_ranks_part_of_the_range():
    placement = RaggedShard(1, [5, 12, 7])
    assert placement.sub_range(4, 12).local_units == (1, 7, 0)
    assert placement.sub_range(0, 24).local_units == (5, 12, 7)
    assert RaggedShard(4, [2, 0, 1]).sub_range(6, 12).local_units == (2, 0, 4)
    with pytest.raises(ValueError, match=r"flat range \[3, 30\) is outside a tensor of 24 elements"):
        placement.sub_range(3, 30)
