"""``fully_shard``: shard a module's parameters eagerly, before (or instead of) the first compile."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .blocks import block_size
from ..options import Fp8Options, check_mp_dtype, check_reshard_after_forward, mp_policy_casts, mp_policy_dtypes
from .buckets import ShardingConfig, check_one_device, numbered_unit
from .fp8_select import plan_fp8
from .forward_casts import register_forward_casts
from .fsdp_module import FSDPPassModule, swap_to_fsdp_class
from ..buckets.ignored import is_ignored, mark_ignored
from .materialize import shard_with_blocks
from .meta_init import MetaInit
from .mesh_roles import model_mesh_dims, resolve_mesh
from ..buckets.mesh import check_reshard_group_size
from ..buckets.uninitialized import check_meta_buffers_before_forward
from ..buckets.gradient_sync import apply_to_buckets
from ..interop.module_apply import keep_shards_on_apply
from ..tensor.ragged_tensor import is_sharded
from ..eager.units import register_unit

__all__ = ["fully_shard"]


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    shard_dim: int | str | tuple[str, ...] | None = None,
    replicate_dim: int | str | None = None,
    bucket_size: int | None = None,
    min_bucket_bytes: int | None = None,
    block_sizes: Mapping[str, Any] | None = None,
    align_bytes: int = 16,
    fp8_all_gather: bool | Mapping[str, Any] | None = None,
    mp_policy: Any = None,
    reshard_after_forward: bool | int | None = True,
    init: str = "replay",
    ignored_params: Iterable[nn.Parameter] | None = None,
    offload_policy: Any = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    dp_mesh_dims: Any = None,
    two_level_collectives: bool = True,
) -> nn.Module:
    """Shard every parameter of ``module`` in place into RaggedShard parameters backed by DBuffers.

    Buckets follow module order (one per unit such as ``layers.3``, at most ``bucket_size``
    elements); a module with no numbered child (a block, or a root whose blocks were sharded first) is
    one unit, as FSDP2 groups it ([Note: a fully_shard call is one unit]). Parameter objects keep their
    identity, so optimizers built earlier keep working; buffers stay replicated; frozen parameters are
    sharded into buckets that collect no gradient.
    Calling it again is a no-op.

    A model built under ``torch.device("meta")`` gets only its local shards allocated, and its
    buffers on the mesh's device. Parameters are initialized by the model's own init, one module
    at a time, in the order a real-device build would run it (bit-equal when seeded; see [Note:
    meta-device init order] in :mod:`fsdp_pass.sharding.meta_init`): ``reset_parameters()``,
    a no-argument ``init_weights()``, and Hugging Face ``_init_weights``. Parameters no init
    reaches are left for a checkpoint (``dcp.load``, ``set_full_state_dict``); using one before
    that raises an error naming it ([Note: uninitialized shards]). Non-persistent buffers no init
    computes stay on the meta device for FSDP2's flow, ``model.to_empty(device=...)`` and the
    model's own init (``init_weights()``), which sharded parameters support: in-place random inits
    draw what one process draws ([Note: buffers left on the meta device]).

    Args:
        module: the model.
        mesh: 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) DeviceMesh; default all ranks.
        shard_dim: the sharding dim of a 2-D mesh (default: the last); on a named mesh with
            tensor/expert-parallel DTensor parameters, the data-parallel dim name(s).
        replicate_dim: the HSDP dim of a named mesh.
        bucket_size: most elements in one bucket.
        min_bucket_bytes: neighbouring units are grouped into buckets of at least this many bytes
            (default: the cost model; 0: one bucket per unit).
        block_sizes: ``{fnmatch pattern: rows}`` or ``{pattern: {"elements": n}}`` blocks never cut.
        align_bytes: alignment of tensor starts and shard sizes.
        fp8_all_gather: ``True`` or ``{"tile": 128, "include": [...], "exclude": [...]}``: the layer
            weights get tile-row blocks and buckets of their own, which the compiled graph gathers as
            FP8 codes and block scales (see ``docs/fp8.md``).
        mp_policy: mixed precision, ``{"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}`` or a
            ``torch.distributed.fsdp.MixedPrecisionPolicy``: the dtype the shards are gathered in (eager
            calls and compiled graphs) and the one compiled graphs reduce gradients in; master shards keep
            their dtype. A compile's ``options["mp_policy"]`` overrides it for that graph. A policy's
            ``cast_forward_inputs`` (default True) casts the module's floating-point inputs to
            ``param_dtype`` and its ``output_dtype`` casts the outputs, as FSDP2's.
        reshard_after_forward: what compiled graphs over these parameters do after forward (FSDP2's
            meaning): True frees the gathered parameters, False keeps them, an int k keeps 1/k of each
            bucket per rank and gathers backward's parameters within groups of k consecutive ranks of
            the shard dim (k divides it, 1 < k < its size); None: False for the outermost
            ``fully_shard``-ed module (the root), True for modules a later ``fully_shard`` encloses. A
            compile's ``options["reshard_after_forward"]``, when not True, overrides it for that graph.
        init: for a meta-device model, ``"replay"`` (default) runs the model's own init into the
            shards as above; ``"skip"`` runs nothing, leaving every parameter and buffer to
            ``to_empty`` + the model's init (or a checkpoint).
        ignored_params: parameters left whole and not reduced, as FSDP2's: neither this call nor the
            backend shards them, and each rank keeps its own gradient ([Note: ignored parameters stay whole]).
        offload_policy: FSDP2's ``OffloadPolicy()`` (no offload) is accepted; ``CPUOffloadPolicy`` is refused:
            CPU offload is not supported yet.
        shard_placement_fn: FSDP2's per-parameter placement: ``Shard(0)`` (rows never cut by a rank
            boundary) becomes a block of one row of that parameter, None keeps fsdp_pass's default
            blocks; other placements are refused.
        dp_mesh_dims: FSDP2's ``DataParallelMeshDims(shard=..., replicate=...)`` on a named mesh: the same as
            ``shard_dim`` and ``replicate_dim``.
        two_level_collectives: gather and reduce in two levels (across the nodes, then within) when the
            launcher reports that a bucket's ranks span nodes (default True; [Note: collectives in two levels
            across nodes] in buckets/node_collectives.py); False: one step over the shard group.

    Returns ``module``, its class swapped to ``FSDP<Cls>``, an ``FSDPModule`` with FSDP2's methods
    ([Note: FSDP2's module class on a fully_shard-ed module] in sharding/fsdp_module.py).
    """
    if isinstance(module, (list, tuple)):
        raise TypeError("fully_shard of a list of modules (FSDP2's one communication group for several modules) is "
                        "not supported: fsdp_pass buckets parameters by module unit itself; call fully_shard on their "
                        "common parent")
    if dp_mesh_dims is not None:
        shard_dim, replicate_dim = _dp_mesh_dims(dp_mesh_dims, shard_dim, replicate_dim)
    if init not in ("replay", "skip"):
        raise ValueError(f"fully_shard's init must be 'replay' or 'skip', got {init!r}")
    param_dtype, reduce_dtype = mp_policy_dtypes(mp_policy)
    check_mp_dtype(param_dtype, "param_dtype")
    check_mp_dtype(reduce_dtype, "reduce_dtype")
    auto_reshard = reshard_after_forward is None  # FSDP2's None: decided by whether a later call encloses it
    if auto_reshard:
        reshard_after_forward = False
    check_reshard_after_forward(reshard_after_forward, "fully_shard's reshard_after_forward")
    _check_offload_policy(offload_policy)
    if ignored_params is not None:
        mark_ignored(ignored_params)  # [Note: ignored parameters stay whole]
    named = [(name, p) for name, p in module.named_parameters(remove_duplicate=True) if not is_ignored(p)]
    sharding_mesh = resolve_mesh(mesh, shard_dim, argument="fully_shard's mesh", replicate_dim=replicate_dim,
                                 model_dims=model_mesh_dims(named), two_levels=two_level_collectives)
    blocks = {name: block_size(name, p, block_sizes) for name, p in named}
    if shard_placement_fn is not None:
        blocks = {name: _placement_block(name, p, shard_placement_fn(p), blocks[name]) for name, p in named}
    fp8 = plan_fp8(named, Fp8Options.parse(fp8_all_gather, "fully_shard's fp8_all_gather"), "fully_shard's fp8_all_gather")
    if not isinstance(reshard_after_forward, bool):
        check_reshard_group_size(reshard_after_forward, sharding_mesh.shard_size, "fully_shard's reshard_after_forward")
    check_one_device(named)
    meta_ids = {id(p) for _, p in named if p.is_meta}
    meta = MetaInit(module, meta_ids, torch.device(sharding_mesh.device_type), replay=init == "replay")
    meta.prepare_buffers()
    try:
        # [Note: a fully_shard call is one unit]
        one_unit = all(numbered_unit(name) is None for name, p in named if not is_sharded(p))
        config = ShardingConfig(bucket_size, align_bytes, param_dtype, min_bucket_bytes, one_unit)
        new = shard_with_blocks(named, sharding_mesh, config, blocks, fp8)
    except BaseException:
        meta.restore_buffers()
        raise
    keep_shards_on_apply(module)  # [Note: Module._apply on sharded parameters]
    for buf in new:
        buf.apply_settings(param_dtype=param_dtype, reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward)
    meta.run()
    if meta.left_on_meta:
        check_meta_buffers_before_forward(module, meta.left_on_meta, meta.names)
    if not isinstance(module, FSDPPassModule):  # a second call on the same module adds no second hooks
        register_forward_casts(module, param_dtype, *mp_policy_casts(mp_policy))
        register_unit(module, new)  # [Note: eager module units]
    _enclose_auto_reshard(module)
    swap_to_fsdp_class(module)  # [Note: FSDP2's module class on a fully_shard-ed module]
    module.__dict__["_fsdp_pass_auto_reshard"] = auto_reshard  # reshard_after_forward=None, root so far
    return module


# [Note: a fully_shard call is one unit]
# The planner buckets a model by its units: a numbered child (``layers.3``) or else each module holding
# parameters, small ones merged up to the bucket cost model's size (sharding/buckets.py). For a whole model
# that gives a bucket per block, which the compiled graph overlaps. A ``fully_shard`` call on a module with no
# numbered child is FSDP2's recipe instead: a block (``fully_shard(block)``), or the root after its blocks
# (embedding, norm and head). There the user asked for one group, and the call's parameters are one unit, so
# they are gathered and reduced once each: per module they would be several buckets (a block's attention and
# feed-forward apart), each a collective of its own, which on gloo costs about 1.3 ms of latency apiece. The
# planner may still split the unit where mixed block sizes would pad it; the eager unit then gathers every
# bucket at entry ([Note: eager module units] in eager/units.py).


def _enclose_auto_reshard(module: nn.Module) -> None:
    """FSDP2's ``reshard_after_forward=None``: a ``fully_shard``-ed module that this call encloses is no
    root any more, so its buckets reshard after forward (True)."""
    for inner in module.modules():
        if inner is not module and isinstance(inner, FSDPPassModule) and inner.__dict__.get("_fsdp_pass_auto_reshard"):
            apply_to_buckets(inner, "fully_shard", inner._own_parameters(), reshard_after_forward=True)
            inner.__dict__["_fsdp_pass_auto_reshard"] = False


def _dp_mesh_dims(dims: Any, shard_dim: Any, replicate_dim: Any) -> tuple[Any, Any]:
    """``(shard_dim, replicate_dim)`` from FSDP2's ``DataParallelMeshDims``."""
    if shard_dim is not None or replicate_dim is not None:
        raise ValueError("fully_shard got dp_mesh_dims and shard_dim/replicate_dim; give the data-parallel dims once")
    if dims.shard is None or isinstance(dims.replicate, tuple):
        raise ValueError(f"fully_shard's dp_mesh_dims is {dims!r}; fsdp_pass needs a shard dim (a name or a tuple of "
                         f"names) and at most one replicate dim name")
    return dims.shard, dims.replicate


def _check_offload_policy(offload_policy: Any) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        return
    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError(
            f"fully_shard's offload_policy={offload_policy!r}: CPU offload is not supported yet by fsdp_pass (shards, "
            f"gradients and optimizer states stay on the mesh's device); drop offload_policy, or shard over more ranks "
            f"to fit"
        )
    raise ValueError(f"fully_shard's offload_policy is {offload_policy!r}; use torch.distributed.fsdp.OffloadPolicy() "
                     f"(no offload) or leave it unset")


def _placement_block(name: str, param: torch.Tensor, placement: Any, block: int) -> int:
    """The block (elements) of ``param`` under FSDP2's ``shard_placement_fn`` answer: ``Shard(0)`` never cuts a row."""
    from torch.distributed.tensor import Shard

    if placement is None:
        return block
    if isinstance(placement, Shard) and param.dim() > 0 and placement.dim % param.dim() == 0:
        return math.lcm(block, math.prod(param.shape[1:]))
    raise ValueError(
        f"shard_placement_fn returned {placement!r} for parameter {name!r} of shape {tuple(param.shape)}; fsdp_pass "
        f"shards flat ranges whose blocks never cross a rank boundary, so it maps only Shard(0) (whole rows) or None "
        f"(its default); for other structures give block_sizes={{{name!r}: {{'elements': n}}}}"
    )
