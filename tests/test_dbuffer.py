"""DBuffer: all-gather gives the parameters as views, reduce-scatter averages gradients into the shard.

Multi-rank checks are grouped into one spawned run per world size (spawning costs seconds per
process); each ``_check_*`` function is one concern, and a failure's traceback names it. Every
check runs on a 1-D mesh and, on 4 ranks, on a 2x2 (replicate, shard) HSDP mesh.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.buckets.dbuffer import DBuffer, note_reached
from fsdp_pass.buckets.gather import gather_bucket
from fsdp_pass.buckets.mesh import ShardingMesh
from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor
from fsdp_pass.sharding.buckets import ShardingConfig
from fsdp_pass.sharding.materialize import shard_parameters

# Odd sizes so that pieces are uneven, some ranks hold nothing of a tensor, and the 16-byte
# alignment puts padding between tensors; two block sizes so the planner has blocks to respect.
PARAM_SHAPES = {"embed": (7, 5), "bias": (13,), "cube": (3, 4, 5), "rows": (6, 8)}
BLOCK_SIZES = {"cube": 20, "rows": 8}

COPY_OPS = {"aten::copy_", "aten::cat", "aten::split_with_sizes_copy", "aten::_chunk_cat"}
COLLECTIVE_PREFIXES = ("_c10d_functional::", "c10d::", "gloo:")


def _original_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in PARAM_SHAPES.items()}


def _sharded_buckets(mesh: ShardingMesh) -> tuple[dict[str, torch.Tensor], list[DBuffer]]:
    """Fresh parameters sharded into buckets over ``mesh``, and plain copies of their values."""
    originals = _original_params()
    params = [(name, nn.Parameter(value.clone())) for name, value in originals.items()]
    buffers = shard_parameters(params, mesh, ShardingConfig(), BLOCK_SIZES)
    assert sorted(n for b in buffers for n in b.names) == sorted(PARAM_SHAPES)
    return originals, buffers


def _known_grad(name: str, dp_rank: int) -> torch.Tensor:
    """The gradient data-parallel rank ``dp_rank`` feeds into parameter ``name``.

    Small integers: their sum over ranks and its division by a power-of-two rank count are exact
    in fp32, so expected gradients can be compared bit for bit whatever order ranks are summed in.
    """
    gen = torch.Generator().manual_seed(1000 * dp_rank + list(PARAM_SHAPES).index(name))
    return torch.randint(-8, 9, PARAM_SHAPES[name], generator=gen).float()


def _averaged_grad(name: str, dp_world: int) -> torch.Tensor:
    return sum(_known_grad(name, r) for r in range(dp_world)) / dp_world


def _expected_shard_grad(buf: DBuffer, dp_world: int) -> torch.Tensor:
    """This rank's slice of the averaged global gradient buffer (padding gets zero gradient)."""
    full = torch.zeros(buf.layout.global_size)
    for name in buf.names:
        start, end = buf.layout.global_range(name)
        full[start:end] = _averaged_grad(name, dp_world).reshape(-1)
    size = buf.layout.shard_size
    return full[buf.rank * size : (buf.rank + 1) * size]


def _as_graph_input(buf: DBuffer) -> torch.Tensor:
    """The shard as the backend hands it to a compiled graph that reads every parameter of the bucket."""
    return note_reached(buf.shard, buf, tuple(buf.names))


def _backward_known_grads(buf: DBuffer, dp_rank: int) -> None:
    """Gather the bucket with autograd, then backpropagate a loss whose gradient per view is known."""
    global_buffer = gather_bucket(_as_graph_input(buf), **buf.config(buf.dtype, buf.dtype)._asdict())
    loss = sum((view * _known_grad(name, dp_rank)).sum() for name, view in buf.views(global_buffer).items())
    loss.backward()


def _events_outside_collectives(prof) -> list:
    """Profiler events that are not a collective nor run inside one (on any thread, gloo's included)."""
    events = list(prof.events())
    collectives = [e for e in events if e.name.startswith(COLLECTIVE_PREFIXES)]

    def inside_collective(e) -> bool:
        return any(
            c.thread == e.thread and c.time_range.start <= e.time_range.start and e.time_range.end <= c.time_range.end
            for c in collectives
        )

    return [e for e in events if not inside_collective(e)]


def _top_level_ops(prof) -> list[str]:
    """Ops called directly by the profiled code (not the ops they call internally)."""
    return [e.name for e in prof.events() if e.cpu_parent is None]


def _ancestry(event) -> str:
    """``outer > ... > event`` names, up to the autograd node or op that issued the event."""
    names = [event.name]
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith("autograd::engine"):
        names.append(parent.name)
        parent = parent.cpu_parent
    return " > ".join(reversed(names))


# ---------------------------------------------------------------------------------------------
# checks (run on every rank)
# ---------------------------------------------------------------------------------------------


def _check_all_gather_gives_the_parameters_as_views(mesh: ShardingMesh) -> None:
    originals, buffers = _sharded_buckets(mesh)
    for buf in buffers:
        global_buffer = buf.all_gather()
        size = buf.layout.shard_size
        assert global_buffer.shape == (buf.layout.global_size,)
        # The local shard is this rank's slice of the gathered buffer: no copy-in was needed.
        assert torch.equal(global_buffer[buf.rank * size : (buf.rank + 1) * size], buf.shard.detach())
        views = buf.views(global_buffer)
        assert sorted(views) == sorted(buf.names)
        for name, view in views.items():
            assert torch.equal(view, originals[name]), name
            # Each parameter is a view of the gathered buffer at its planned offset: no copy-out.
            assert view.untyped_storage().data_ptr() == global_buffer.untyped_storage().data_ptr(), name
            assert view.storage_offset() == global_buffer.storage_offset() + buf.layout.global_range(name)[0], name


def _check_gradient_is_averaged_into_the_shard(mesh: ShardingMesh, dp_rank: int, dp_world: int) -> None:
    _, buffers = _sharded_buckets(mesh)
    for buf in buffers:
        _backward_known_grads(buf, dp_rank)
        expected = _expected_shard_grad(buf, dp_world)
        grad_shard = buf.gradient_buffer()
        assert torch.equal(grad_shard, expected), (buf, grad_shard - expected)
        assert buf.shard.grad is None  # the parameters' views hold the gradient shard, not the shard's .grad
        for name, p in buf.params.items():
            assert isinstance(p.grad, RaggedShardTensor), name
            piece = p.grad._local
            # The parameter's gradient is a view into the one gradient shard, at the parameter's offset.
            assert piece.untyped_storage().data_ptr() == grad_shard.untyped_storage().data_ptr(), name
            start, end = buf.layout.shard_range(name, buf.rank)
            assert piece.storage_offset() == grad_shard.storage_offset() + start, name
            assert piece.numel() == end - start, name
            assert p.grad.placement == p.placement and p.grad.shape == p.shape, name
            assert torch.equal(p.grad.full_tensor(), _averaged_grad(name, dp_world)), name

        # A second backward accumulates in place: same gradient shard, parameters' grads still view it.
        grads_before = {name: p.grad for name, p in buf.params.items()}
        shard_grad_address = grad_shard.data_ptr()
        _backward_known_grads(buf, dp_rank)
        assert buf.gradient_buffer().data_ptr() == shard_grad_address, buf
        assert torch.equal(buf.gradient_buffer(), 2 * expected), buf
        for name, p in buf.params.items():
            assert p.grad is grads_before[name], name
            assert torch.equal(p.grad.full_tensor(), 2 * _averaged_grad(name, dp_world)), name


def _check_fused_grad_ops_act_on_every_view_at_once(mesh: ShardingMesh, dp_rank: int, dp_world: int) -> None:
    _, buffers = _sharded_buckets(mesh)
    buf = max(buffers, key=lambda b: len(b.names))
    assert len(buf.names) > 1, buf  # one op covering several parameters is what is under test
    _backward_known_grads(buf, dp_rank)
    expected = _expected_shard_grad(buf, dp_world)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        buf.scale_grad_(0.5)
    assert _top_level_ops(prof) == ["aten::mul_"], _top_level_ops(prof)
    for name, p in buf.params.items():
        start, end = buf.layout.shard_range(name, buf.rank)
        assert torch.equal(p.grad._local, expected[start:end] * 0.5), name

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        buf.zero_grad_()
    assert _top_level_ops(prof) == ["aten::zero_"], _top_level_ops(prof)
    for name, p in buf.params.items():
        assert p.grad._local.count_nonzero() == 0, name
    assert buf.gradient_buffer().count_nonzero() == 0, buf


def _check_forward_gather_makes_no_copies(mesh: ShardingMesh) -> None:
    """The eager all-gather plus ``views`` copy nothing outside the collective.

    gloo's own all_gather copies each rank's chunk into the output on its worker thread: that is
    the collective itself, excluded here.
    """
    _, buffers = _sharded_buckets(mesh)
    for buf in buffers:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            buf.views(buf.all_gather())
        names = [e.name for e in prof.events()]
        assert "_c10d_functional::all_gather_into_tensor" in names, names  # the profile saw the gather
        outside = [_ancestry(e) for e in _events_outside_collectives(prof) if e.name in COPY_OPS]
        assert outside == [], (buf, outside)


def _check_backward_copies_are_the_known_ones(mesh: ShardingMesh, dp_rank: int) -> None:
    """The backward of gather + views copies exactly twice outside the collectives.

    * ``aten::cat`` in ``SplitWithSizesBackward0``: the per-parameter gradients are concatenated
      into one global gradient buffer (zeros for padding) before the reduce-scatter. This is the
      known copy-in that zero-copy gradients (writing them straight into one buffer) would remove.
    * ``aten::copy_`` of a 0-dim tensor in ``aten::div``: eager torch materialises the Python
      scalar divisor (the rank count of the average) as a tensor; it copies 4 bytes, no gradient data.

    gloo's reduce-scatter (an all-reduce of a clone, then a copy of this rank's chunk) copies inside
    the collective; those are excluded. The gradients fed in are the views' own incoming gradients
    (no loss), so nothing else runs in the profiled backward.
    """
    _, buffers = _sharded_buckets(mesh)
    expected_copies = [
        "SplitWithSizesBackward0 > aten::cat",
        "_GatherBucketBackward > aten::div > aten::to > aten::_to_copy > aten::copy_",
    ]
    for buf in buffers:
        views = buf.views(gather_bucket(_as_graph_input(buf), **buf.config(buf.dtype, buf.dtype)._asdict()))
        known = [_known_grad(name, dp_rank) for name in views]
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            torch.autograd.backward(list(views.values()), known)
        names = [e.name for e in prof.events()]
        assert "_c10d_functional::reduce_scatter_tensor" in names, names  # the profile saw the reduction
        copies = [e for e in _events_outside_collectives(prof) if e.name in COPY_OPS]
        assert [_ancestry(e) for e in copies] == expected_copies, (buf, [_ancestry(e) for e in copies])
        scalar_copy = copies[1]
        assert scalar_copy.input_shapes[0] == [], scalar_copy.input_shapes  # 0-dim: the divisor only


def _all_checks(mesh: ShardingMesh, dp_rank: int, dp_world: int) -> None:
    _check_all_gather_gives_the_parameters_as_views(mesh)
    _check_gradient_is_averaged_into_the_shard(mesh, dp_rank, dp_world)
    _check_fused_grad_ops_act_on_every_view_at_once(mesh, dp_rank, dp_world)
    _check_forward_gather_makes_no_copies(mesh)
    _check_backward_copies_are_the_known_ones(mesh, dp_rank)


def _run_on_ranks(rank: int, world: int) -> None:
    _all_checks(ShardingMesh(init_device_mesh("cpu", (world,))), rank, world)
    if world == 4:
        # HSDP: sharded over dim 1, replicated over dim 0; gradients average over all 4 ranks.
        hsdp = ShardingMesh(init_device_mesh("cpu", (2, 2)), shard_dim=1)
        assert hsdp.shard_size == 2 and hsdp.replicate_size == 2
        _all_checks(hsdp, rank, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_dbuffer_on_gloo_ranks(world: int) -> None:
    run_distributed(_run_on_ranks, world)


def test_dbuffer_in_one_process_without_a_process_group() -> None:
    """mesh=None: the bucket is one rank's whole buffer; gather and gradient need no communication."""
    mesh = ShardingMesh(None)
    _check_all_gather_gives_the_parameters_as_views(mesh)
    _check_gradient_is_averaged_into_the_shard(mesh, dp_rank=0, dp_world=1)
    _check_fused_grad_ops_act_on_every_view_at_once(mesh, dp_rank=0, dp_world=1)
