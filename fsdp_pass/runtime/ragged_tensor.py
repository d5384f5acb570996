"""RaggedShardTensor: a tensor whose flattened elements are split over the ranks of one mesh dim.

The wrapper carries the *global* shape, dtype and device; each rank stores only its piece, one
contiguous 1-D range of the row-major flattened tensor (``RaggedShard.local_range``). The piece is
often a view into a flat bucket buffer, so nothing here copies it on construction.

Eager ops run through ``__torch_dispatch__`` on the pieces, but only where that is exact:

* elementwise ops (``torch.Tag.pointwise``, in-place and ``out=`` forms, ``*_like``, ``clone``,
  ``detach``, ``zero_``, ``fill_``, ``copy_``, ``_to_copy``), ``_foreach_*`` ops and the fused
  optimizer kernels, between tensors of one layout and Python scalars or 0-dim plain tensors;
* full reductions (vector norms, ``sum``, ``max``/``min``, ``dot``): reduce the piece, then
  all-reduce over the mesh dim; the result is a plain, replicated tensor.

That is what ``torch.optim`` optimizers and ``clip_grad_norm_`` need (importing this module also
lets their ``foreach`` defaults treat RaggedShard tensors like plain ones, as DTensor does).
Everything else raises rather than compute something silently wrong on a piece.

Under ``torch.compile`` the same dispatch runs on fake/functional pieces: elementwise ops trace as
ops on the locals and reductions as functional collectives in the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map_only

from ..placement import RaggedShard, transfer_splits
from . import checkpoint, collectives

__all__ = ["RaggedShardTensor", "RaggedSpec", "distribute_tensor", "local_block", "ragged_part"]

aten = torch.ops.aten


@dataclass(frozen=True)
class RaggedSpec:
    """The layout of a :class:`RaggedShardTensor`: global shape, placement, and where it is split.

    ``mesh=None`` means a single process (world size 1, no communication). On a multi-dim mesh the
    tensor is ragged over ``mesh_dim`` and replicated over the other dims (HSDP), so reductions
    communicate over ``mesh_dim`` only. Hashable: it is the ``__tensor_flatten__`` context.
    """

    shape: torch.Size
    placement: RaggedShard
    mesh: DeviceMesh | None
    mesh_dim: int = 0
    # Inside a tensor/expert-parallel DTensor: ``shape`` is the DTensor's local shape, and this
    # tensor's local block starts at ``global_offset`` of the DTensor's ``global_shape`` (None: not inside one).
    global_shape: torch.Size | None = None
    global_offset: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if self.global_shape is not None:
            object.__setattr__(self, "global_shape", torch.Size(self.global_shape))
        if self.mesh is not None and not 0 <= self.mesh_dim < self.mesh.ndim:
            raise ValueError(f"mesh_dim {self.mesh_dim} is outside a {self.mesh.ndim}-dim mesh {self.mesh}")
        self.placement.validate(self.shape, self.world_size, name=f"tensor of shape {tuple(self.shape)}")

    @property
    def world_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size(self.mesh_dim)

    @property
    def rank(self) -> int:
        """This process's coordinate along ``mesh_dim``."""
        return 0 if self.mesh is None else self.mesh.get_local_rank(self.mesh_dim)

    @property
    def group(self) -> ProcessGroup | None:
        """Process group of ``mesh_dim``; ``None`` without a mesh (the collectives then skip)."""
        return None if self.mesh is None else self.mesh.get_group(self.mesh_dim)

    @property
    def local_range(self) -> tuple[int, int]:
        """``[start, end)`` of this rank's piece in the flattened tensor."""
        return self.placement.local_range(self.rank)

    @property
    def local_numel(self) -> int:
        return self.placement.local_numel(self.rank)

    def describe(self) -> str:
        where = "a single process" if self.mesh is None else f"mesh dim {self.mesh_dim} of {self.mesh}"
        inside = "" if self.global_shape is None else (
            f" (the local block at offset {self.global_offset} of a DTensor of shape {tuple(self.global_shape)})")
        return f"shape {tuple(self.shape)}{inside}, {self.placement} over {where}"


class RaggedShardTensor(torch.Tensor):
    """A traceable wrapper subclass: global metadata outside, this rank's flat piece inside.

    Build one with :meth:`from_local` (wraps an existing piece, no copy) or
    :func:`distribute_tensor` (slices a full tensor every rank holds).
    """

    _local: torch.Tensor
    _spec: RaggedSpec

    # Ops go straight to __torch_dispatch__ (no torch-function layer), as torch.compile expects.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: RaggedSpec, requires_grad: bool = False) -> "RaggedShardTensor":
        return torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=_contiguous_strides(spec.shape),
            dtype=local.dtype,
            device=local.device,
            layout=local.layout,
            requires_grad=requires_grad,
        )

    def __init__(self, local: torch.Tensor, spec: RaggedSpec, requires_grad: bool = False) -> None:
        self._local = local
        self._spec = spec

    # -- construction and conversion ---------------------------------------------------------
    @staticmethod
    def from_local(
        local: torch.Tensor,
        mesh: DeviceMesh | None,
        placement: RaggedShard,
        shape: Sequence[int],
        mesh_dim: int = 0,
        requires_grad: bool = False,
        global_shape: Sequence[int] | None = None,
        global_offset: Sequence[int] | None = None,
    ) -> "RaggedShardTensor":
        """Wrap this rank's contiguous 1-D piece (kept as is, typically a view into a buffer).

        Not differentiable: gradients are tracked on the wrapper, never through ``local``.
        ``global_shape``/``global_offset``: when this is the local tensor of a tensor- or
        expert-parallel DTensor, where its block lies in the DTensor (checkpoints save global boxes).
        """
        spec = RaggedSpec(torch.Size(shape), placement, mesh, mesh_dim,
                          None if global_shape is None else torch.Size(global_shape),
                          None if global_offset is None else tuple(global_offset))
        if local.dim() != 1 or local.numel() != spec.local_numel or not local.is_contiguous():
            raise ValueError(
                f"from_local: rank {spec.rank} must pass a contiguous 1-D piece of {spec.local_numel} "
                f"elements for {spec.describe()}, got shape {tuple(local.shape)} with strides {local.stride()}"
            )
        # detach() aliases the same memory; it only keeps the piece out of autograd.
        return RaggedShardTensor(local.detach() if local.requires_grad else local, spec, requires_grad)

    def to_local(self) -> torch.Tensor:
        """This rank's flat piece (the stored tensor itself, not a copy)."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, on every rank of ``mesh_dim`` (one padded all-gather; not differentiable)."""
        spec = self._spec
        sizes = [spec.placement.local_numel(r) for r in range(spec.world_size)]
        return collectives.all_gather_padded(self._local, sizes, spec.group).view(spec.shape)

    def redistribute(self, placement: RaggedShard) -> "RaggedShardTensor":
        """The same tensor in another RaggedShard layout over the same mesh dim (not differentiable).

        One uneven ``all_to_all_single`` moves every element straight to its new owner. Returns
        ``self`` when the layout does not change.
        """
        spec = self._spec
        if placement == spec.placement:
            return self
        target = RaggedSpec(spec.shape, placement, spec.mesh, spec.mesh_dim)
        send, recv = transfer_splits(spec.placement, placement, spec.rank)
        local = collectives.all_to_all_uneven(self._local, send, recv, spec.group)
        return RaggedShardTensor(local, target)

    @property
    def placement(self) -> RaggedShard:
        return self._spec.placement

    @property
    def mesh(self) -> DeviceMesh | None:
        return self._spec.mesh

    # -- traceable wrapper subclass protocol -------------------------------------------------
    # -- distributed checkpoint (torch.distributed.checkpoint saves and loads local pieces) ------
    def __create_write_items__(self, fqn: str, obj: torch.Tensor):
        # obj is self, or the tensor-parallel DTensor whose local tensor this is.
        return checkpoint.create_write_items(fqn, self)

    def __create_chunk_list__(self):
        return checkpoint.create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        return checkpoint.get_tensor_shard(self, index)

    def __tensor_flatten__(self) -> tuple[list[str], RaggedSpec]:
        return ["_local"], self._spec

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], spec: RaggedSpec, outer_size: Any, outer_stride: Any
    ) -> "RaggedShardTensor":
        local = inner_tensors["_local"]
        return RaggedShardTensor(local, spec, requires_grad=local.requires_grad)

    def __repr__(self) -> str:
        return f"RaggedShardTensor({self._spec.describe()}, local={self._local!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Dynamo tracing model code on sharded parameters (optimizer list ops never take this path)
        if not _is_per_tensor_list_op(func) and _pieces_are_fake(args, kwargs) and _mixes_with_plain_tensors(args, kwargs):
            return _run_on_full_shape_stand_ins(func, args, kwargs)
        if func.namespace == "_c10d_functional" and not _pieces_are_fake(args, kwargs):
            return _collective_on_whole_tensors(func, args, kwargs)
        special = _SPECIAL_HANDLERS.get(func)
        if special is not None:
            return special(func, args, kwargs)
        if torch.Tag.pointwise in func.tags or func.overloadpacket in _LAYOUT_KEEPING_OPS:
            return _run_elementwise(func, args, kwargs)
        if _is_per_tensor_list_op(func):
            return _run_per_list_entry(func, args, kwargs)
        if _pieces_are_fake(args, kwargs):
            return _run_on_full_shape_stand_ins(func, args, kwargs)
        raise _unsupported(func, args, kwargs)


def ragged_part(t: torch.Tensor) -> torch.Tensor:
    """What FSDP shards of ``t``: a tensor/expert-parallel DTensor's local tensor, else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_block(full: torch.Tensor, spec) -> torch.Tensor:
    """This rank's block of the global tensor ``full`` under a DTensor ``spec`` (a view, no copy)."""
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def distribute_tensor(
    full: torch.Tensor, mesh: DeviceMesh | None, placement: RaggedShard, mesh_dim: int = 0
) -> RaggedShardTensor:
    """Shard a tensor every rank already holds: keep (a copy of) this rank's slice, no communication."""
    spec = RaggedSpec(full.shape, placement, mesh, mesh_dim)
    start, end = spec.local_range
    local = full.detach().reshape(-1)[start:end].clone()
    return RaggedShardTensor(local, spec, requires_grad=full.requires_grad)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# ---------------------------------------------------------------------------------------------
# Dispatch: layout checks
# ---------------------------------------------------------------------------------------------

# Not tagged pointwise, but they keep the layout: each output element depends at most on the same input element.
_LAYOUT_KEEPING_OPS = {
    aten.zeros_like, aten.empty_like, aten.ones_like, aten.full_like,
    aten.detach, aten.zero_, aten.fill_, aten._to_copy,
}  # fmt: skip

_FUSED_OPTIMIZER_OPS = {"aten::_fused_adamw_", "aten::_fused_adam_", "aten::_fused_sgd_"}

_FULL_TENSOR_HINT = (
    "call .full_tensor() to work on the whole tensor, "
    'or compile the model with torch.compile(..., backend="vescale")'
)


def _is_per_tensor_list_op(func) -> bool:
    name = func._schema.name
    return name.startswith("aten::_foreach_") or name in _FUSED_OPTIMIZER_OPS


def _op_name(func) -> str:
    return f"aten.{func._schema.name.split('::')[-1]}.{func._overloadname}"


def _shared_spec(func, values: Sequence[Any]) -> RaggedSpec | None:
    """The one layout of the RaggedShard tensors in ``values``; raise if layouts mix.

    Plain tensors may join only as 0-dim scalars: a plain tensor with dims has no piece to pair
    with this rank's piece.
    """
    spec = None
    for value in values:
        if isinstance(value, RaggedShardTensor):
            if spec is None:
                spec = value._spec
            elif value._spec is not spec and value._spec != spec:
                raise ValueError(
                    f"{_op_name(func)}: cannot combine RaggedShard tensors of different layouts "
                    f"({spec.describe()} vs {value._spec.describe()}); redistribute one to the other's placement"
                )
    if spec is not None:
        for value in values:
            if isinstance(value, torch.Tensor) and not isinstance(value, RaggedShardTensor) and value.dim() != 0:
                raise ValueError(
                    f"{_op_name(func)}: cannot combine a RaggedShardTensor ({spec.describe()}) with a plain "
                    f"tensor of shape {tuple(value.shape)}; only Python scalars and 0-dim tensors mix with "
                    f"RaggedShard pieces. Shard it first (distribute_tensor with the same placement) "
                    f"or {_FULL_TENSOR_HINT}"
                )
    return spec


def _pieces_are_fake(args, kwargs) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(t, RaggedShardTensor) and isinstance(t._local, FakeTensor) for t in leaves)


def _mixes_with_plain_tensors(args, kwargs) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(t, torch.Tensor) and not isinstance(t, RaggedShardTensor) and t.dim() > 0 for t in leaves)


def _run_on_full_shape_stand_ins(func, args, kwargs):
    """Shape propagation while Dynamo traces a model whose parameters are already sharded.

    Dynamo records the torch-level call (``F.linear(x, weight)``) and only needs output metadata; the
    vescale backend then replaces every parameter use by a view of the gathered bucket, so these
    stand-ins never reach a compiled graph. Only fake pieces take this path: real data still raises.
    """
    stand_in = lambda t: t._local.new_empty(t.shape, dtype=t.dtype)  # noqa: E731
    return func(*tree_map_only(RaggedShardTensor, stand_in, args), **tree_map_only(RaggedShardTensor, stand_in, kwargs))


def _unwrap(tree: Any) -> Any:
    """``tree`` with every RaggedShardTensor replaced by its local piece.

    Arguments shaped like the optimizer's (tensors, lists of tensors, scalars, one level of nesting)
    are unwrapped directly: pytree's generic walk costs more than the elementwise kernels of a
    small model's optimizer step.
    """
    if isinstance(tree, RaggedShardTensor):
        return tree._local
    if isinstance(tree, list):
        return [_unwrap(x) if isinstance(x, (RaggedShardTensor, list)) else x for x in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_unwrap(x) if isinstance(x, (RaggedShardTensor, list, tuple, dict)) else x for x in tree)
    return tree_map_only(RaggedShardTensor, lambda t: t._local, tree)


def _bound_arguments(func, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in (dispatch drops trailing defaults)."""
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _unsupported(func, args, kwargs) -> NotImplementedError:
    ragged, _ = tree_flatten((args, kwargs))
    layouts = "; ".join(t._spec.describe() for t in ragged if isinstance(t, RaggedShardTensor))
    return NotImplementedError(
        f"{_op_name(func)} is not supported on RaggedShardTensor ({layouts}). Each rank holds only a flat "
        f"range of the tensor, so eagerly only elementwise ops, optimizer (_foreach_/_fused_) ops and full "
        f"reductions run on the pieces; {_FULL_TENSOR_HINT}"
    )


# ---------------------------------------------------------------------------------------------
# Dispatch: elementwise ops run on the pieces
# ---------------------------------------------------------------------------------------------


def _run_elementwise(func, args, kwargs):
    spec = _shared_spec(func, tree_flatten((args, kwargs))[0])
    out = func(*_unwrap(args), **_unwrap(kwargs))
    return _with_outputs_wrapped(func, args, kwargs, out, lambda piece: _wrap_piece(func, piece, spec))


def _run_per_list_entry(func, args, kwargs):
    """``_foreach_*`` / fused optimizer ops: entry ``i`` of every list argument must share a layout."""
    bound = _bound_arguments(func, args, kwargs)
    if _has_dtensor_entries(bound):
        return _split_off_dtensor_entries(func, bound)
    lists, scalars = [], []
    for arg in func._schema.arguments:
        value = bound.get(arg.name)
        if isinstance(value, (list, tuple)):
            lists.append(value)
        # "scalars" of addcdiv_/addcmul_ holds one value per list entry, not per element.
        elif isinstance(value, torch.Tensor) and arg.name != "scalars":
            scalars.append(value)
    entries = max((len(values) for values in lists), default=0)
    specs = [
        _shared_spec(func, [values[i] for values in lists if i < len(values)] + scalars) for i in range(entries)
    ]
    out = func(*_unwrap(args), **_unwrap(kwargs))
    return _with_outputs_wrapped(
        func, args, kwargs, out, lambda pieces: [_wrap_piece(func, p, s) for p, s in zip(pieces, specs)]
    )


def _has_dtensor_entries(bound: dict[str, Any]) -> bool:
    return any(isinstance(v, (list, tuple)) and any(isinstance(t, DTensor) for t in v) for v in bound.values())


def _split_off_dtensor_entries(func, bound: dict[str, Any]):
    """A list op over RaggedShard parameters and tensor-parallel DTensor ones (whose local tensors are
    RaggedShard): one call for each kind, since DTensor dispatch only takes DTensors.

    ``clip_grad_norm_`` and optimizers group gradients by device and dtype only, so the kinds mix.
    A 0-dim DTensor operand (a total norm) joins the non-DTensor call as its value.
    """
    lengths = {len(v) for v in bound.values() if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor)}
    entries = max(lengths)
    is_dtensor = [any(isinstance(v[i], DTensor) for v in bound.values()
                      if isinstance(v, (list, tuple)) and len(v) == entries) for i in range(entries)]
    results: list[Any] = [None] * entries
    returned = None
    for kind in (True, False):
        chosen = [i for i in range(entries) if is_dtensor[i] == kind]
        if not chosen:
            continue
        call = {}
        for name, value in bound.items():
            if isinstance(value, (list, tuple)) and len(value) == entries:
                value = [value[i] for i in chosen]
            elif isinstance(value, DTensor) and not kind:
                value = value.full_tensor()
            call[name] = value
        out = func(**call)
        if isinstance(out, (list, tuple)) and len(out) == len(chosen):
            returned = True
            for i, o in zip(chosen, out):
                results[i] = o
    return results if returned else None


def _wrap_piece(func, piece: Any, spec: RaggedSpec | None) -> Any:
    if spec is None or not isinstance(piece, torch.Tensor):
        return piece
    if piece.shape != (spec.local_numel,):
        # e.g. _foreach_max: a per-piece reduction would be silently wrong if wrapped.
        raise NotImplementedError(
            f"{_op_name(func)} turned a RaggedShard piece of {spec.local_numel} elements into shape "
            f"{tuple(piece.shape)}: it is not elementwise, so it cannot run on pieces; {_FULL_TENSOR_HINT}"
        )
    return RaggedShardTensor(piece, spec)


def _with_outputs_wrapped(func, args, kwargs, out, wrap: Callable[[Any], Any]):
    """In-place and ``out=`` results are the caller's own tensors; the rest are wrapped pieces."""
    returns = func._schema.returns
    if not returns:
        return out
    outs = (out,) if len(returns) == 1 else tuple(out)
    results = []
    for ret, value in zip(returns, outs):
        written = _written_argument(func, ret, args, kwargs)
        results.append(written if written is not None else wrap(value))
    return results[0] if len(returns) == 1 else tuple(results)


def _written_argument(func, ret, args, kwargs) -> Any:
    alias = ret.alias_info
    if alias is None or not alias.is_write:
        return None
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
            return args[i] if i < len(args) else kwargs[arg.name]
    return None


def _copy_(func, args, kwargs):
    """``dst.copy_(src)``: from a same-layout RaggedShard tensor, a 0-dim scalar, or the full tensor."""
    bound = _bound_arguments(func, args, kwargs)
    dst, src = bound["self"], bound["src"]
    if not isinstance(dst, RaggedShardTensor):
        raise NotImplementedError(
            f"{_op_name(func)}: copying a RaggedShardTensor ({src._spec.describe()}) into a plain tensor of shape "
            f"{tuple(dst.shape)} needs the whole tensor: copy from .full_tensor() instead"
        )
    if isinstance(src, RaggedShardTensor):
        _shared_spec(func, [dst, src])
        piece = src._local
    elif src.dim() == 0:
        piece = src
    elif src.shape == dst.shape:
        start, end = dst._spec.local_range
        piece = src.reshape(-1)[start:end]
    else:
        raise ValueError(
            f"{_op_name(func)}: cannot copy a plain tensor of shape {tuple(src.shape)} into a RaggedShardTensor "
            f"({dst._spec.describe()}); pass the full tensor (same shape) or a 0-dim scalar"
        )
    aten.copy_.default(dst._local, piece, bound["non_blocking"])
    return dst


# ---------------------------------------------------------------------------------------------
# Dispatch: full reductions = reduce the piece, then all-reduce over the mesh dim
# ---------------------------------------------------------------------------------------------


def _require_full_reduction(func, args, kwargs, x: torch.Tensor, dim: Any) -> None:
    if dim is None:
        return
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims or {d % max(x.dim(), 1) for d in dims} == set(range(max(x.dim(), 1))):
        return
    raise _unsupported(func, args, kwargs)


def _keep_dims(result: torch.Tensor, x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    return result.reshape([1] * x.dim()) if keepdim else result


def _vector_norm(func, args, kwargs):
    bound = _bound_arguments(func, args, kwargs)
    x = bound["self"]
    _require_full_reduction(func, args, kwargs, x, bound["dim"])
    norm = _global_norms([x], bound["ord"], bound["dtype"])[0]
    return _keep_dims(norm, x, bound["keepdim"])


def _foreach_norm(func, args, kwargs):
    """Per-tensor global norms, with one all-reduce per process group (not one per tensor)."""
    bound = _bound_arguments(func, args, kwargs)
    tensors, ord, dtype = bound["self"], bound["ord"], bound["dtype"]
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    by_group: dict[tuple[DeviceMesh | None, int], list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, RaggedShardTensor):
            by_group.setdefault((t._spec.mesh, t._spec.mesh_dim), []).append(i)
        else:
            norms[i] = aten.linalg_vector_norm.default(t, ord, dtype=dtype)
    for indices in by_group.values():
        for i, norm in zip(indices, _global_norms([tensors[i] for i in indices], ord, dtype)):
            norms[i] = norm
    return norms


def _global_norms(tensors: list[RaggedShardTensor], ord: float, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Vector norms of whole tensors sharing one process group, with one all-reduce for all of them.

    Each rank contributes ``|piece|_p ** p`` for finite p (in float64, so combining the pieces adds
    no rounding of note), its max for p = inf or its min for p = -inf; empty pieces contribute
    the identity.
    """
    ord = float(ord)
    partials = torch.full(
        (len(tensors),), math.inf if ord == -math.inf else 0.0, dtype=torch.float64, device=tensors[0]._local.device
    )
    held = [i for i, t in enumerate(tensors) if t._local.numel() > 0]
    if held:
        local_norms = aten._foreach_norm.Scalar([tensors[i]._local for i in held], ord, dtype)
        local = torch.stack(local_norms).to(torch.float64)
        partials[held] = local if ord in (0.0, math.inf, -math.inf) else local**ord
    group = tensors[0]._spec.group
    if ord == math.inf:
        combined = _all_reduce_extremum(partials, group, "max")
    elif ord == -math.inf:
        combined = _all_reduce_extremum(partials, group, "min")
    else:
        combined = collectives.all_reduce_(partials, group, "sum")
        if ord != 0.0:
            combined = combined ** (1.0 / ord)
    return [combined[i].to((dtype or t.dtype).to_real()) for i, t in enumerate(tensors)]


def _all_reduce_extremum(values: torch.Tensor, group: ProcessGroup | None, op: str) -> torch.Tensor:
    """MAX/MIN all-reduce that keeps NaN (gloo's elementwise max may drop a NaN operand)."""
    if not values.is_floating_point():
        return collectives.all_reduce_(values, group, op)
    nan_flags = values.isnan().to(values.dtype)
    # One collective for values and flags: the flag is 1 (MAX) or -1 (MIN) wherever a rank saw NaN.
    stacked = torch.stack([values, nan_flags if op == "max" else -nan_flags])
    collectives.all_reduce_(stacked, group, op)
    return torch.where(stacked[1] != 0, torch.full_like(stacked[0], math.nan), stacked[0])


def _sum(func, args, kwargs):
    bound = _bound_arguments(func, args, kwargs)
    x = bound["self"]
    _require_full_reduction(func, args, kwargs, x, bound.get("dim"))
    total = aten.sum.default(x._local, dtype=bound["dtype"])
    return _keep_dims(collectives.all_reduce_(total, x._spec.group, "sum"), x, bound.get("keepdim", False))


def _extremum(func, args, kwargs):
    """max/min/amax/amin over the whole tensor."""
    bound = _bound_arguments(func, args, kwargs)
    x = bound["self"]
    _require_full_reduction(func, args, kwargs, x, bound.get("dim"))
    if x.numel() == 0:
        return func(*_unwrap(args), **_unwrap(kwargs))  # torch's own error for an empty tensor
    op = "max" if func.overloadpacket in (aten.max, aten.amax) else "min"
    local = x._local
    if local.numel() == 0:
        value = torch.full((), _reduction_identity(x.dtype, op), dtype=x.dtype, device=local.device)
    else:
        value = aten.amax.default(local) if op == "max" else aten.amin.default(local)
    return _keep_dims(_all_reduce_extremum(value, x._spec.group, op), x, bound.get("keepdim", False))


def _reduction_identity(dtype: torch.dtype, op: str) -> float | int | bool:
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _collective_on_whole_tensors(func, args, kwargs):
    """A collective over *another* mesh dim, e.g. a tensor-parallel DTensor's ``full_tensor()`` of its
    RaggedShard local tensor: gather the whole local tensor over this tensor's own dim first."""
    whole = lambda t: t.full_tensor()  # noqa: E731
    return func(*tree_map_only(RaggedShardTensor, whole, args), **tree_map_only(RaggedShardTensor, whole, kwargs))


def _dot(func, args, kwargs):
    spec = _shared_spec(func, args[:2])
    return collectives.all_reduce_(func(*_unwrap(args), **_unwrap(kwargs)), spec.group, "sum")


_SPECIAL_HANDLERS: dict[Any, Callable] = {
    aten.copy_.default: _copy_,
    aten.linalg_vector_norm.default: _vector_norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.sum.default: _sum,
    aten.sum.dim_IntList: _sum,
    aten.max.default: _extremum,
    aten.min.default: _extremum,
    aten.amax.default: _extremum,
    aten.amin.default: _extremum,
    aten.dot.default: _dot,
    aten.vdot.default: _dot,
}


def _register_for_foreach_defaults() -> None:
    """Let optimizers and clip_grad_norm_ pick their foreach paths by default, as for plain tensors."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if RaggedShardTensor not in supported:
            supported.append(RaggedShardTensor)


_register_for_foreach_defaults()
