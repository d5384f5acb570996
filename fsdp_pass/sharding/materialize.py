"""Turn bucket plans into DBuffers and swap each parameter, in place, into a RaggedShard parameter.

Parameter objects keep their identity (:mod:`fsdp_pass.tensor.swap`), so optimizers built
earlier keep working. Shared by ``fully_shard`` and the backend's shard pass.

[Note: FSDP over TP/EP]
A tensor- or expert-parallel parameter is a DTensor on its own mesh dims. It stays that DTensor
(mesh, placements, global shape unchanged); only its *local tensor* becomes a RaggedShard piece,
sharded over the mesh dims its placements do not use (:meth:`ParallelMesh.for_parameter`). So
the order is "TP/EP first, then FSDP": the bucket holds local tensors, the rewritten graph
rebuilds each DTensor around its gathered local view (``DTensor.from_local``), and the model's
own TP/EP collectives run unchanged. Code that needs "what FSDP shards" of a parameter calls
:func:`~fsdp_pass.tensor.ragged_tensor.ragged_part`. For checkpoints the piece also records its
local block's global offset and the global shape, so DCP writes global boxes. A DTensor built on
the meta device (torchtitan: TP plan, ``fully_shard(init="skip")``, ``to_empty``, ``init_weights``) is
rebuilt around its piece in place, so it reports the shard's device and ``to_empty`` keeps it
([Note: Module._apply on sharded parameters]); its init then draws like one process
([Note: random init of FSDP-over-TP parameters]).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from ..buckets.dbuffer import DBuffer, queue_flush_all
from ..buckets.list_kernels import install_list_kernels_for_sharded_parameters
from ..buckets.mesh import ShardingMesh
from ..buckets.settings import apply_recorded
from ..eager.calls import eager_gradient_added, reduce_eager_gradient, reduce_gradient_of_swapped_out
from ..interop.mixed_lists import install_mixed_list_handlers
from ..interop.state_dict import install_state_dict_api
from ..interop.torch_patches import install_full_state_dict_gather, install_wrapper_refusals
from ..step.sync_check import install_plain_gradient_check
from ..tensor.ragged_tensor import (RaggedLocalDTensor, holds_pieces, is_sharded, local_block, over_pieces,
                                     ragged_part, register_for_foreach_defaults)
from ..tensor.swap import check_swappable, in_live_graph, swap_in_place
from .buckets import BucketPlan, ShardingConfig, check_parameter, plan_parameter_buckets
from .fp8_select import Fp8Plan, lcm_blocks
from .mesh_roles import ParallelMesh

__all__ = ["materialize", "shard_parameters"]

_bucket_ids = itertools.count()  # names buckets uniquely in graphs and logs


def shard_parameters(
    named_params: Iterable[tuple[str, nn.Parameter]],
    mesh: ShardingMesh | ParallelMesh,
    config: ShardingConfig = ShardingConfig(),
    block_sizes: Mapping[str, int] | None = None,
    fp8_tiles: Mapping[str, int] | None = None,
) -> list[DBuffer]:
    """Plan buckets for the parameters (in the given order) and swap each into a RaggedShard parameter.

    Parameters already sharded are skipped (their DBuffer is kept). A parameter object listed twice
    (tied weights) is sharded once. Returns the new DBuffers. A tensor/expert-parallel DTensor
    parameter stays a DTensor (see [Note: FSDP over TP/EP]). ``fp8_tiles`` (name → tile) are
    the weights gathered in FP8, planned into buckets of their own ([Note: FP8 all-gather]).
    """
    seen: set[int] = set()
    todo: list[tuple[str, nn.Parameter]] = []
    for name, p in named_params:
        if is_sharded(p):
            continue
        check_parameter(name, p)
        if id(p) not in seen:
            seen.add(id(p))
            todo.append((name, p))
    plans = plan_parameter_buckets(todo, mesh, config, dict(block_sizes or {}), fp8_tiles)
    for name, p in todo:  # every check before the first swap: an error must never leave a module half sharded
        if not isinstance(p, DTensor):
            check_swappable(p, f"parameter {name!r}")
    return materialize(plans, mesh.device_type)


def materialize(plans: list[BucketPlan], device_type: str) -> list[DBuffer]:
    """Allocate one DBuffer per plan, fill it from the parameters' values and swap the parameters in."""
    install_state_dict_api()  # [Note: torch's state-dict API on sharded models]
    install_full_state_dict_gather()
    register_for_foreach_defaults()
    install_plain_gradient_check()  # [Note: parameters left out of sharding]
    install_list_kernels_for_sharded_parameters()  # [Note: list kernels for sharded parameters]
    install_wrapper_refusals()  # [Note: wrappers around a sharded model]
    if any(isinstance(p, DTensor) for plan in plans for p in plan.params.values()):
        install_mixed_list_handlers()  # [Note: list ops mixing DTensor and RaggedShard parameters]
        _install_whole_random_fills()  # [Note: random init of FSDP-over-TP parameters]
    buffers: list[DBuffer] = []
    for plan in plans:
        layout, by_name = plan.layout, plan.params
        shapes = {n: ragged_part(by_name[n]).shape for n in layout.names}
        specs = {n: by_name[n]._spec for n in layout.names if isinstance(by_name[n], DTensor)}
        device = by_name[layout.names[0]].device
        if device.type == "meta":  # only the local shard is allocated; meta_init fills it
            device = torch.device(device_type)
        buf = DBuffer(layout, shapes, plan.mesh, plan.dtype, device, plan.trainable, index=next(_bucket_ids),
                      dtensor_specs=specs, fp8_tile=plan.fp8_tile)
        for name in layout.names:
            if not by_name[name].is_meta:
                buf.load_full(name, ragged_part(by_name[name]))
        for name in layout.names:
            _swap_into_bucket(buf, name, by_name[name])
        apply_recorded(buf, [by_name[n] for n in layout.names])  # [Note: settings recorded before sharding]
        if plan.trainable:
            # Hooks live in C++, out of the garbage collector's sight: a strong reference to the
            # buffer there would keep the whole model alive forever.
            ref = weakref.ref(buf)
            buf.shard.register_hook(functools.partial(_resume_gradient, ref))  # [Note: gradient shard lifetime]
            buf.shard.register_post_accumulate_grad_hook(functools.partial(_hand_gradient_to_parameters, ref))
            for name in layout.names:  # gradients of eager calls: [Note: eager calls on sharded parameters]
                p = by_name[name]
                if p.requires_grad:
                    p.register_hook(functools.partial(reduce_eager_gradient, ref, name))
                    p.register_post_accumulate_grad_hook(functools.partial(eager_gradient_added, ref))
        buffers.append(buf)
    return buffers


# [Note: random init of FSDP-over-TP parameters]
# On a CPU mesh DTensor has no RNG tracker: an in-place random fill (``normal_``, ``uniform_``, the
# building blocks of ``torch.nn.init``) draws each rank's local block from the default generator, so
# TP ranks get the same numbers and none matches a one-process init. For a DTensor whose local tensor
# is a RaggedShard piece (a meta-built model after ``to_empty``, initialized by its own code), every
# rank instead draws the whole global tensor from the same generator, keeps its TP block and, of
# that, its FSDP piece: each element gets one process's value and the generator ends in one
# process's state. Costs one whole parameter of memory while it runs. ``any``/``all`` of such a
# DTensor (``trunc_normal_``'s rejection loop asks ``mask.any()``) answer for the whole global
# tensor on every rank, so all ranks redraw as often as one process does. Other DTensors take
# DTensor's own dispatch.
_RANDOM_FILLS = tuple(getattr(packet, overload) for packet in (
    torch.ops.aten.normal_, torch.ops.aten.uniform_, torch.ops.aten.bernoulli_, torch.ops.aten.exponential_,
    torch.ops.aten.log_normal_, torch.ops.aten.cauchy_, torch.ops.aten.geometric_, torch.ops.aten.random_)
    for overload in packet.overloads())


def _dtensor_default(op, args: tuple, kwargs: dict):
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = handler


def _over_pieces(t, args: tuple, kwargs: dict) -> bool:
    return (isinstance(t, DTensor) and holds_pieces(t, real=True)
            and not any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())))


def _any_or_all_whole(op, args: tuple, kwargs: dict):
    x = args[0]
    if not _over_pieces(x, args, kwargs):
        return _dtensor_default(op, args, kwargs)
    is_any = op is torch.ops.aten.any.default
    verdict = op(x._local_tensor).to(torch.int32)  # over this TP block (its pieces' ranks reduce)
    mesh = x.device_mesh
    for dim in range(mesh.ndim):
        dist.all_reduce(verdict, dist.ReduceOp.MAX if is_any else dist.ReduceOp.MIN, group=mesh.get_group(dim))
    return DTensor.from_local(verdict.to(torch.bool), mesh, [Replicate()] * mesh.ndim, run_check=False)


def _fill_whole(op, args: tuple, kwargs: dict):
    dst = args[0]
    if not _over_pieces(dst, args, kwargs):
        return _dtensor_default(op, args, kwargs)
    local = dst._local_tensor
    whole = torch.empty(dst.shape, dtype=dst.dtype, device=local.piece.device)
    op(whole, *args[1:], **kwargs)
    torch.ops.aten.copy_.default(local, local_block(whole, dst._spec))
    return dst


def _install_whole_random_fills() -> None:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _RANDOM_FILLS:
        handlers.setdefault(op, _fill_whole)
    for op in (torch.ops.aten.any.default, torch.ops.aten.all.default):
        handlers.setdefault(op, _any_or_all_whole)


def _resume_gradient(ref: weakref.ref, incoming: torch.Tensor | None) -> None:
    """Before autograd accumulates into the shard: give it back the parameters' live gradient buffer (the
    graph already left frozen parameters' pieces out of ``incoming``: :func:`note_reached`). An undefined
    ``incoming`` (a graph that hands this bucket's gradient to a pending leaf instead) adds nothing."""
    buf = ref()
    if buf is not None and incoming is not None:
        buf.shard.grad = buf.gradient_buffer()


def _hand_gradient_to_parameters(ref: weakref.ref, shard: torch.Tensor) -> None:
    """After: the parameters' ``.grad`` views hold the buffer, the shard lets it go."""
    buf = ref()
    if buf is not None and shard.grad is not None:
        grad, shard.grad = shard.grad, None
        buf.attach_reduced(lambda: grad)
        queue_flush_all()  # what earlier micro-batches accumulated without sync


def _swap_into_bucket(buf: DBuffer, name: str, p: nn.Parameter) -> None:
    if isinstance(p, DTensor):  # see [Note: FSDP over TP/EP]
        piece = buf.ragged(name, buf.local_piece(name))
        if p.device == piece.device:
            p._local_tensor = piece
            p.__class__ = RaggedLocalDTensor  # [Note: DTensors over RaggedShard local tensors]
        else:  # built on meta: the wrapper reports its local tensor's device, so it is rebuilt on the shard's
            rebuilt = nn.Parameter(over_pieces(piece, p._spec), requires_grad=p.requires_grad)
            rebuilt.__dict__.update((k, v) for k, v in p.__dict__.items() if k not in rebuilt.__dict__)
            swap_in_place(p, rebuilt)
    else:
        used = in_live_graph(p)
        sharded = nn.Parameter(buf.ragged(name, buf.local_piece(name)), requires_grad=p.requires_grad)
        swap_in_place(p, sharded)  # `sharded` now holds p's old contents
        if used:  # [Note: a parameter used before it was sharded]
            sharded.register_post_accumulate_grad_hook(
                functools.partial(reduce_gradient_of_swapped_out, weakref.ref(buf), name))
    buf.adopt(name, p)


def shard_with_blocks(named: list[tuple[str, nn.Parameter]], mesh: ShardingMesh, config: ShardingConfig,
                      blocks: Mapping[str, int], fp8: Fp8Plan) -> list[DBuffer]:
    """The sharding sequence ``fully_shard``, pass 2 and the planning CLI share: each FP8 weight's block
    made whole tile panels, buckets planned and materialized, left-out FP8 candidates told to their bucket."""
    new = shard_parameters(named, mesh, config, lcm_blocks(blocks, fp8.blocks), fp8.tiles)
    fp8.record_left_out(named)
    return new
