"""RaggedShardTensor: round trips, redistribution, optimizers, clipping and reductions vs plain tensors.

Multi-rank checks are grouped into one spawned run per world size (spawning costs seconds per
process); each ``_check_*`` function is one concern, and a failure's traceback names it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.placement import RaggedShard
from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor, RaggedSpec, distribute_tensor

# (shape, block): odd sizes, a 1-D tensor, a 3-D tensor whose blocks are whole matrices.
TENSORS = [((7, 5), 5), ((13,), 1), ((3, 4, 5), 20), ((6, 8), 16), ((2, 3), 1)]
# Every cut at a multiple of 64 elements (see _check_optimizers_match_plain_bitwise).
SIMD_ALIGNED_TENSORS = [((4, 64), 64), ((3, 128), 128), ((5, 64), 64)]

OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
]
IMPLEMENTATIONS = [dict(foreach=False), dict(foreach=True), dict(fused=True)]


def _random_units(blocks: int, world: int, seed: int) -> tuple[int, ...]:
    """A random split of ``blocks`` over ``world`` ranks; zeros appear often."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, blocks + 1, (world - 1,), generator=gen).tolist())
    bounds = [0, *cuts, blocks]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _layouts(shape, block: int, world: int) -> list[RaggedShard]:
    """Even, one-hot on every rank, zero units on every other rank, and random splits."""
    numel = math.prod(shape)
    blocks = numel // block
    layouts = [RaggedShard.even(numel, world, block)]
    layouts += [RaggedShard(block, tuple(blocks if r == root else 0 for r in range(world))) for root in range(world)]
    holders = list(range(0, world, 2))
    base, extra = divmod(blocks, len(holders))
    layouts.append(
        RaggedShard(block, tuple((base + (holders.index(r) < extra)) if r in holders else 0 for r in range(world)))
    )
    layouts += [RaggedShard(block, _random_units(blocks, world, seed)) for seed in range(3)]
    return layouts


def _full(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _layout_with_a_zero_rank(shape, block: int, world: int, seed: int) -> RaggedShard:
    """A random split (world >= 2) in which rank 1 holds nothing."""
    units = list(_random_units(math.prod(shape) // block, world - 1, seed))
    units.insert(1, 0)
    return RaggedShard(block, tuple(units))


# ---------------------------------------------------------------------------------------------
# multi-rank checks
# ---------------------------------------------------------------------------------------------


def _check_full_tensor_round_trips(mesh, world: int) -> None:
    for i, (shape, block) in enumerate(TENSORS):
        full = _full(shape, i)
        for layout in _layouts(shape, block, world):
            rs = distribute_tensor(full, mesh, layout)
            start, end = layout.local_range(mesh.get_local_rank())
            assert torch.equal(rs.to_local(), full.reshape(-1)[start:end]), layout
            assert rs.shape == full.shape and rs.stride() == full.stride() and rs.dtype == full.dtype
            assert torch.equal(rs.full_tensor(), full), layout
            copied = torch.zeros_like(rs).copy_(full)  # RS <- plain full tensor keeps this rank's slice
            assert torch.equal(copied.to_local(), rs.to_local()) and copied._spec == rs._spec
            assert hash(rs._spec) == hash(RaggedSpec(full.shape, layout, mesh))
    empty = distribute_tensor(torch.empty(0, 3), mesh, RaggedShard(3, (0,) * world))
    assert empty.full_tensor().shape == (0, 3)


def _check_redistribute_round_trips(mesh, world: int) -> None:
    rank = mesh.get_local_rank()
    for i, (shape, block) in enumerate(TENSORS):
        full = _full(shape, 10 + i)
        layouts = _layouts(shape, block, world)
        for layout in layouts:
            rs = distribute_tensor(full, mesh, layout)
            for root in range(world):
                on_root = rs.redistribute(RaggedShard.on_root(full.numel(), world, root))
                expected = full.reshape(-1) if rank == root else full.reshape(-1)[:0]
                assert torch.equal(on_root.to_local(), expected), (layout, root)
                back = on_root.redistribute(layout)
                assert back.placement == layout and torch.equal(back.to_local(), rs.to_local()), (layout, root)
            other = layouts[-1]
            moved = rs.redistribute(other)
            start, end = other.local_range(rank)
            assert torch.equal(moved.to_local(), full.reshape(-1)[start:end]), (layout, other)
            assert rs.redistribute(layout) is rs


def _make_params(mesh, seed: int, mesh_dim: int = 0, tensors=TENSORS):
    """RaggedShard parameters (rank 1 of ``mesh_dim`` holding nothing) and plain copies of them."""
    ragged, plain = [], []
    for i, (shape, block) in enumerate(tensors):
        full = _full(shape, seed + i)
        layout = _layout_with_a_zero_rank(shape, block, mesh.size(mesh_dim), seed + i)
        ragged.append(nn.Parameter(distribute_tensor(full, mesh, layout, mesh_dim=mesh_dim)))
        plain.append(nn.Parameter(full.clone()))
    return ragged, plain


def _set_grads(ragged, plain, seed: int) -> None:
    for i, (r, p) in enumerate(zip(ragged, plain)):
        grad = _full(p.shape, 1000 * seed + i)
        p.grad = grad.clone()
        r.grad = distribute_tensor(grad, r.mesh, r.placement, r._spec.mesh_dim)


def _assert_matches(ragged, plain, what: str, exact: bool = True) -> None:
    for i, (r, p) in enumerate(zip(ragged, plain)):
        assert isinstance(r, RaggedShardTensor), what
        full = r.full_tensor()
        if exact:
            assert torch.equal(full, p.detach()), f"{what}: param {i} differs by {(full - p).abs().max()}"
        else:
            torch.testing.assert_close(full, p.detach(), msg=f"{what}: param {i}")


def _check_optimizer(mesh, cls, hyper: dict, impl: dict, tensors, exact: bool) -> None:
    what = f"{cls.__name__}({hyper}, {impl})"
    ragged, plain = _make_params(mesh, seed=7, tensors=tensors)
    opt_ragged, opt_plain = cls(ragged, **hyper, **impl), cls(plain, **hyper, **impl)
    for step in range(10):
        _set_grads(ragged, plain, seed=step)
        opt_ragged.step()
        opt_plain.step()
        if step in (0, 9):
            _assert_matches(ragged, plain, f"{what} after {step + 1} steps", exact)
        opt_ragged.zero_grad(set_to_none=step % 2 == 0)
        opt_plain.zero_grad(set_to_none=step % 2 == 0)
    state = opt_ragged.state[ragged[0]]
    assert all(isinstance(v, RaggedShardTensor) for k, v in state.items() if k != "step"), what


def _check_optimizers_match_plain_bitwise(mesh, world: int) -> None:
    for cls, hyper in OPTIMIZERS:
        for impl in IMPLEMENTATIONS:
            if cls is torch.optim.SGD and impl.get("fused"):
                # torch's CPU fused SGD kernel uses FMA in its SIMD body but not in its scalar tail,
                # so even on plain tensors its result depends on where a slice starts modulo the
                # SIMD width: bitwise equality needs cuts at multiples of it, otherwise ~1 ulp.
                _check_optimizer(mesh, cls, hyper, impl, SIMD_ALIGNED_TENSORS, exact=True)
                _check_optimizer(mesh, cls, hyper, impl, TENSORS, exact=False)
            else:
                _check_optimizer(mesh, cls, hyper, impl, TENSORS, exact=True)


def _check_clip_grad_norm(mesh, world: int) -> None:
    for norm_type in (2.0, math.inf, 1.0, 3.0):
        for foreach in (None, True, False):
            ragged, plain = _make_params(mesh, seed=3)
            _set_grads(ragged, plain, seed=5)
            max_norm = 0.5
            total = torch.nn.utils.clip_grad_norm_(ragged, max_norm, norm_type=norm_type, foreach=foreach)
            expected = torch.nn.utils.clip_grad_norm_(plain, max_norm, norm_type=norm_type, foreach=foreach)
            assert type(total) is torch.Tensor and total.dim() == 0
            assert math.isclose(total.item(), expected.item(), rel_tol=1e-6), (norm_type, foreach, total, expected)
            # Clipping applies the returned norm exactly as plain tensors apply theirs.
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for i, r in enumerate(ragged):
                unclipped = _full(r.shape, 1000 * 5 + i)
                assert torch.equal(r.grad.full_tensor(), unclipped * coef), (norm_type, foreach)


def _check_reductions(mesh, world: int) -> None:
    for i, (shape, block) in enumerate(TENSORS):
        full = _full(shape, 20 + i)
        other = _full(shape, 40 + i)
        layout = _layout_with_a_zero_rank(shape, block, world, i)
        x, y = distribute_tensor(full, mesh, layout), distribute_tensor(other, mesh, layout)
        for ord in (2, math.inf, -math.inf, 0, 1, 3, 0.5):
            got = torch.linalg.vector_norm(x, ord)
            assert type(got) is torch.Tensor and got.dtype == full.dtype
            assert torch.allclose(got, torch.linalg.vector_norm(full, ord), rtol=1e-6), (shape, ord)
        assert torch.allclose(torch._foreach_norm([x, y])[1], other.norm(), rtol=1e-6)
        norm64 = torch.linalg.vector_norm(x, keepdim=True, dtype=torch.float64)
        assert torch.allclose(norm64, torch.linalg.vector_norm(full, keepdim=True, dtype=torch.float64), rtol=1e-12)
        assert torch.allclose(x.sum(), full.sum(), rtol=1e-5, atol=1e-5)
        dims = list(range(full.dim()))
        assert torch.allclose(x.sum(dims, keepdim=True), full.sum(dims, keepdim=True), rtol=1e-5, atol=1e-5)
        assert torch.equal(x.max(), full.max()) and torch.equal(x.min(), full.min())
        assert torch.equal(x.amax(), full.amax())
        assert torch.equal(x.amax(dims, keepdim=True), full.amax(dims, keepdim=True))
        flat_layout = RaggedShard(1, tuple(u * block for u in layout.local_units))
        flat_x = distribute_tensor(full.reshape(-1), mesh, flat_layout)
        flat_y = distribute_tensor(other.reshape(-1), mesh, flat_x.placement)
        assert torch.allclose(torch.dot(flat_x, flat_y), torch.dot(full.reshape(-1), other.reshape(-1)), rtol=1e-5)
        assert torch.allclose(torch.vdot(flat_x, flat_y), torch.vdot(full.reshape(-1), other.reshape(-1)), rtol=1e-5)
    # A NaN on one rank survives the MAX all-reduce, whichever rank holds it.
    for holder in range(world):
        full = torch.arange(4.0 * world)
        full[4 * holder] = math.nan
        x = distribute_tensor(full, mesh, RaggedShard(4, (1,) * world))
        assert x.max().isnan() and torch.linalg.vector_norm(x, math.inf).isnan(), holder


def _check_layout_errors(mesh, world: int) -> None:
    full = _full((4, 6), 0)
    a = distribute_tensor(full, mesh, RaggedShard.even(24, world, 6))
    b = distribute_tensor(full, mesh, RaggedShard(6, (4,) + (0,) * (world - 1)))
    with pytest.raises(ValueError, match=r"aten\.add\.Tensor.*different layouts"):
        a + b
    with pytest.raises(ValueError, match=r"aten\._foreach_add_\.List.*different layouts"):
        torch._foreach_add_([a], [b])
    with pytest.raises(NotImplementedError, match=r"aten\.mm\.default.*full_tensor"):
        torch.mm(a, full.T)


def _check_2d_mesh_norms_not_double_counted() -> None:
    """Ragged over mesh dim 1, replicated over dim 0: reductions use dim 1's group only."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ragged, plain = _make_params(mesh, seed=11, mesh_dim=1)
    _set_grads(ragged, plain, seed=12)
    for r, p in zip(ragged, plain):
        assert r._spec.world_size == 2 and torch.equal(r.full_tensor(), p.detach())
        assert torch.allclose(torch.linalg.vector_norm(r.grad), torch.linalg.vector_norm(p.grad), rtol=1e-6)
        assert torch.allclose(r.grad.sum(), p.grad.sum(), rtol=1e-5, atol=1e-5)
    total = torch.nn.utils.clip_grad_norm_(ragged, 0.5, foreach=True)
    expected = torch.nn.utils.clip_grad_norm_(plain, 0.5, foreach=True)
    assert math.isclose(total.item(), expected.item(), rel_tol=1e-6)
    opt_ragged = torch.optim.AdamW(ragged, lr=1e-2, fused=True)
    opt_plain = torch.optim.AdamW(plain, lr=1e-2, fused=True)
    _set_grads(ragged, plain, seed=13)
    opt_ragged.step()
    opt_plain.step()
    _assert_matches(ragged, plain, "AdamW on a 2x2 mesh")
    moved = ragged[0].redistribute(RaggedShard.on_root(ragged[0].numel(), 2, 1))
    assert torch.equal(moved.full_tensor(), plain[0].detach())


def _check_compiled_reduction(mesh) -> None:
    """Reductions trace too: their all-reduce is a functional collective in the graph."""
    full = _full((5, 4), 0)
    x = distribute_tensor(full, mesh, RaggedShard(4, (2, 3)))
    norm, y = torch.compile(lambda a: (torch.linalg.vector_norm(a), a * 3 + 1), backend="aot_eager", fullgraph=True)(x)
    assert torch.allclose(norm, full.norm(), rtol=1e-6)
    assert isinstance(y, RaggedShardTensor) and torch.equal(y.full_tensor(), full * 3 + 1)


def _all_checks(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    _check_full_tensor_round_trips(mesh, world)
    _check_redistribute_round_trips(mesh, world)
    _check_optimizers_match_plain_bitwise(mesh, world)
    _check_clip_grad_norm(mesh, world)
    _check_reductions(mesh, world)
    _check_layout_errors(mesh, world)
    if world == 2:
        _check_compiled_reduction(mesh)
    if world == 4:
        _check_2d_mesh_norms_not_double_counted()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ragged_shard_tensor_on_gloo_ranks(world: int) -> None:
    run_distributed(_all_checks, world)


# ---------------------------------------------------------------------------------------------
# single process (mesh=None)
# ---------------------------------------------------------------------------------------------


def test_from_local_wraps_the_piece_without_copying() -> None:
    buffer = torch.arange(30.0)
    rs = RaggedShardTensor.from_local(buffer[6:30], None, RaggedShard(6, (4,)), (4, 6), requires_grad=True)
    assert rs.to_local().data_ptr() == buffer[6:].data_ptr()
    assert rs.shape == (4, 6) and rs.stride() == (6, 1) and rs.requires_grad and rs.mesh is None
    rs.detach().mul_(2)
    assert torch.equal(buffer[6:], torch.arange(6.0, 30.0) * 2)
    with pytest.raises(ValueError, match="contiguous 1-D piece of 24"):
        RaggedShardTensor.from_local(buffer[:6], None, RaggedShard(6, (4,)), (4, 6))
    with pytest.raises(ValueError, match="sum to 3 blocks"):
        RaggedSpec(torch.Size((4, 6)), RaggedShard(6, (3,)), None)


def test_single_process_ops_match_plain() -> None:
    full = torch.randn(5, 3)
    x = distribute_tensor(full, None, RaggedShard(3, (5,)))
    assert torch.equal(x.full_tensor(), full)
    assert torch.equal((x * 2 + 1).full_tensor(), full * 2 + 1)
    assert torch.equal(torch.where(x > 0, x, 0.5).full_tensor(), torch.where(full > 0, full, 0.5))
    assert torch.equal((x * torch.tensor(3.0)).full_tensor(), full * 3)
    for like in (torch.zeros_like(x), torch.ones_like(x), torch.full_like(x, 2.0), torch.empty_like(x), x.clone()):
        assert isinstance(like, RaggedShardTensor) and like._spec == x._spec
    assert torch.equal(torch.full_like(x, 2.0).full_tensor(), torch.full_like(full, 2.0))
    y = torch.zeros_like(x)
    assert y.add_(1) is y and torch.equal(y.full_tensor(), torch.ones_like(full))
    y.copy_(full)
    assert torch.equal(y.full_tensor(), full)
    y.zero_().copy_(x)
    assert torch.equal(y.full_tensor(), full)
    half = x.to(torch.bfloat16)
    assert isinstance(half, RaggedShardTensor) and half.dtype == torch.bfloat16
    assert torch.equal(half.full_tensor(), full.to(torch.bfloat16))
    out = torch.empty_like(x)
    assert torch.maximum(x, y, out=out) is out
    assert torch.allclose(torch.linalg.vector_norm(x), full.norm())
    plain_norm, ragged_norm = torch._foreach_norm([torch.ones(3), x])
    assert torch.allclose(plain_norm, torch.tensor(3.0).sqrt()) and torch.allclose(ragged_norm, full.norm())
    # Compiled optimizers pass one scalar per list entry as a 1-D tensor ("scalars").
    z = x.clone()
    torch._foreach_addcdiv_([z], [x], [x.abs() + 1], torch.tensor([0.5]))
    assert torch.equal(z.full_tensor(), torch.addcdiv(full, full, full.abs() + 1, value=0.5))
    assert torch.equal(x.amax(), full.amax()) and torch.allclose(x.sum(), full.sum())
    with pytest.raises(ValueError, match=r"aten\.add\.Tensor.*plain tensor of shape \(5, 3\)"):
        x + full
    with pytest.raises(NotImplementedError, match=r"aten\._foreach_max\.default.*not elementwise"):
        torch._foreach_max([x])
    with pytest.raises(NotImplementedError, match=r"aten\.sum\.dim_IntList.*vescale"):
        x.sum(0)
    assert torch.equal(x.view(15).full_tensor(), full.view(15))  # the same flat order: the same piece
    with pytest.raises(NotImplementedError, match=r"aten\.(t|transpose)"):
        x.t()


def test_pointwise_and_foreach_dispatch_on_fake_pieces() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        piece = torch.empty(24)
        x = RaggedShardTensor.from_local(piece, None, RaggedShard(6, (4,)), (4, 6))
        y = (x * 2).sqrt_()
        torch._foreach_addcmul_([x], [y], [y], value=0.5)
        (z,) = torch._foreach_mul([x], 3.0)
    assert isinstance(z, RaggedShardTensor) and z.shape == (4, 6)
    assert type(z.to_local()).__name__ == "FakeTensor"


def test_compiled_pointwise_function_on_ragged_inputs() -> None:
    full = torch.rand(4, 6)
    x = distribute_tensor(full, None, RaggedShard(1, (24,)))
    fn = torch.compile(lambda a, b: (a * 2 + b).sqrt(), backend="aot_eager", fullgraph=True)
    out = fn(x, x)
    assert isinstance(out, RaggedShardTensor) and torch.equal(out.full_tensor(), (full * 3).sqrt())
