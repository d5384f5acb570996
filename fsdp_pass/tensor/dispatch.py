"""How aten ops run on RaggedShardTensors: the body of ``RaggedShardTensor.__torch_dispatch__``.

Each rank holds one flat range of a tensor, so an op runs on the pieces only where that is exact:

* elementwise ops (``torch.Tag.pointwise``, in-place and ``out=`` forms, ``*_like``, ``clone``,
  ``detach``, ``zero_``, ``fill_``, ``copy_``, ``_to_copy``), ``_foreach_*`` ops and the fused
  optimizer kernels, between tensors of one layout and Python scalars or 0-dim plain tensors;
* full reductions (vector norms, ``sum``, ``max``/``min``, ``any``/``all``, ``dot``): reduce the
  piece, then all-reduce over the mesh dim; the result is a plain, replicated tensor;
* in-place random fills (``normal_``, ``uniform_``, ...): the whole tensor is drawn, the piece kept;
* ops that keep the row-major flat order, on tensors that are not parameters (state-dict values,
  gradients): ``view``/``reshape`` (the same piece under another shape) and ``split``/``chunk``/
  ``narrow``/``unbind`` along dim 0 (each part keeps the run of its elements this rank holds), so
  ``state_dict`` hooks that split a fused weight (QKV) hand DCP sharded parts.

Everything else raises rather than compute something silently wrong on a piece. :func:`dispatch`
tries its cases in order; the first that applies handles the op.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map_only

from . import collectives, flat_buffers, in_flight
from .ragged_tensor import BUCKET_ATTR, PARAMETER_NAME, RaggedShardTensor, RaggedSpec, bucket_of, is_sharded

aten = torch.ops.aten


def dispatch(func, args: tuple, kwargs: dict[str, Any] | None) -> Any:
    """Run ``func`` on RaggedShard arguments: the first case that applies handles it."""
    call = _OpCall(func, args, kwargs or {})
    if in_flight.any_in_flight():  # [Note: the last reduce-scatter overlaps the optimizer step]
        in_flight.settle_read(t.piece for t in call.leaves if isinstance(t, RaggedShardTensor))
    if _is_model_code_on_fake_pieces(call):
        return _run_on_full_shape_stand_ins(call)
    if _is_collective_on_real_pieces(call):
        return _collective_on_whole_tensors(call)
    if func in _SPECIAL_HANDLERS:  # copy_ and the full reductions (table at the bottom)
        return _SPECIAL_HANDLERS[func](call)
    if _is_same_shape_view(call):  # DTensor.to_local's view_as: the piece itself, still in its bucket
        return _detach(call)
    if _is_eager_model_code(call):  # [Note: eager calls on sharded parameters] in eager/calls.py
        return call.run_with_replaced(_whole_parameter)
    if _keeps_layout(call):
        return _run_elementwise(call)
    if _is_per_tensor_list_op(call):
        return _run_per_list_entry(call)
    if call.func in _FLAT_ORDER_OPS and not call.pieces_are_fake:
        return _FLAT_ORDER_OPS[call.func](call)
    if call.pieces_are_fake:
        return _run_on_full_shape_stand_ins(call)
    raise _unsupported(call)


def _whole_parameter(p: RaggedShardTensor) -> torch.Tensor:
    """The whole value of sharded parameter ``p``, from its bucket ([Note: eager calls on sharded parameters])."""
    buf, name = bucket_of(p)
    return buf.whole_parameter(name)


class _OpCall:
    """One dispatched op call. The facts that cost a pytree walk are worked out on first use, once:
    optimizer list ops never need them, and walking their long lists would cost more than the op."""

    __slots__ = ("func", "args", "kwargs", "_leaves", "_pieces_are_fake", "_bound")

    def __init__(self, func, args: tuple, kwargs: dict[str, Any]) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self._leaves: list[Any] | None = None
        self._pieces_are_fake: bool | None = None
        self._bound: dict[str, Any] | None = None

    @property
    def leaves(self) -> list[Any]:
        """Every argument value, nested containers flattened."""
        if self._leaves is None:
            self._leaves = _flat_leaves(self.args, self.kwargs)
        return self._leaves

    @property
    def pieces_are_fake(self) -> bool:
        """Whether a RaggedShard argument holds a FakeTensor piece: tracing, not real data."""
        if self._pieces_are_fake is None:
            self._pieces_are_fake = any(
                isinstance(t, RaggedShardTensor) and isinstance(t.piece, FakeTensor) for t in self.leaves
            )
        return self._pieces_are_fake

    @property
    def bound(self) -> dict[str, Any]:
        """Arguments by schema name, defaults filled in (dispatch drops trailing defaults)."""
        if self._bound is None:
            self._bound = {}
            for i, arg in enumerate(self.func._schema.arguments):
                if i < len(self.args):
                    self._bound[arg.name] = self.args[i]
                elif arg.name in self.kwargs:
                    self._bound[arg.name] = self.kwargs[arg.name]
                elif arg.has_default_value():
                    self._bound[arg.name] = arg.default_value
        return self._bound

    def run_on_pieces(self) -> Any:
        """The op itself, on every RaggedShard argument's local piece."""
        out = self.func(*_unwrap(self.args), **_unwrap(self.kwargs))
        if _is_mutable(self.func):
            self.count_writes()
        return out

    def count_writes(self) -> None:
        """Bump the version counter of every written piece (and so of its bucket's shard).

        Autograd counted the write on the wrapper, above dispatch; below it, writes to the pieces
        count nothing. Readers keyed on the shard's version (eager/calls.py) must see them.
        """
        written = []
        for arg in self.func._schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = self.bound.get(arg.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, RaggedShardTensor):
                        written.append(t.piece)
        torch.autograd.graph.increment_version(written)  # one call for a whole optimizer list

    def run_with_replaced(self, replace: Callable[[RaggedShardTensor], torch.Tensor]) -> Any:
        """The op itself, with every RaggedShard argument ``t`` replaced by ``replace(t)``."""
        return self.func(*_replaced(self.args, replace), **_replaced(self.kwargs, replace))


def _flat_leaves(args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """``tree_flatten((args, kwargs))``'s leaves, without pytree's generic walk for the shapes aten calls take
    (values, and lists or tuples of values): an eager model op pays this on every call
    ([Note: eager calls on sharded parameters] in eager/calls.py)."""
    leaves: list[Any] = []
    for value in (*args, *kwargs.values()):
        if type(value) in (list, tuple, torch.Size):
            for item in value:
                if isinstance(item, (list, tuple, dict)):
                    return tree_flatten((args, kwargs))[0]
            leaves.extend(value)
        elif isinstance(value, (list, tuple, dict)):  # a subclass (named tuple) or a dict: pytree knows them
            return tree_flatten((args, kwargs))[0]
        else:
            leaves.append(value)
    return leaves


# ---------------------------------------------------------------------------------------------
# The cases, in the order dispatch tries them
# ---------------------------------------------------------------------------------------------

# Not tagged pointwise, but they keep the layout: each output element depends at most on the same input element.
_LAYOUT_KEEPING_OPS = {
    aten.zeros_like, aten.empty_like, aten.ones_like, aten.full_like,
    aten.detach, aten.zero_, aten.fill_, aten._to_copy,
}  # fmt: skip



def _is_model_code_on_fake_pieces(call: _OpCall) -> bool:
    """Dynamo tracing model code on sharded parameters (optimizer list ops never take this path)."""
    return not _is_per_tensor_list_op(call) and call.pieces_are_fake and _mixes_with_plain_tensors(call)


def _is_eager_model_code(call: _OpCall) -> bool:
    """Model code reading sharded parameters outside a compiled graph: a matmul, a view, a broadcast
    against activations. Optimizer and clipping math (elementwise among pieces, list ops, in-place
    writes) keeps running on the pieces."""
    if _is_mutable(call.func) or _is_per_tensor_list_op(call) or call.pieces_are_fake:
        return False  # cheap checks first: optimizer list ops must not pay for flattening their lists
    ragged = [t for t in call.leaves if isinstance(t, RaggedShardTensor)]
    if not all(map(is_sharded, ragged)):
        return False
    return _mixes_with_plain_tensors(call) or not _keeps_layout(call)


def _is_same_shape_view(call: _OpCall) -> bool:
    if call.func not in (aten.view.default, aten._unsafe_view.default) or call.pieces_are_fake:
        return False
    x = call.args[0]
    return isinstance(x, RaggedShardTensor) and tuple(call.args[1]) == tuple(x.shape)


def _mixes_with_plain_tensors(call: _OpCall) -> bool:
    return any(
        isinstance(t, torch.Tensor) and not isinstance(t, RaggedShardTensor) and t.dim() > 0 for t in call.leaves
    )


def _is_collective_on_real_pieces(call: _OpCall) -> bool:
    return call.func.namespace == "_c10d_functional" and not call.pieces_are_fake


def _keeps_layout(call: _OpCall) -> bool:
    return torch.Tag.pointwise in call.func.tags or call.func.overloadpacket in _LAYOUT_KEEPING_OPS


@functools.cache
def is_list_op(func) -> bool:
    """``_foreach_*`` and fused optimizer ops: one tensor per list entry, entry ``i`` of every list together."""
    name = func._schema.name
    return name.startswith("aten::_foreach_") or name in flat_buffers.FUSED_OPTIMIZER_OPS


@functools.cache
def _is_mutable(func) -> bool:
    return func._schema.is_mutable


def _is_per_tensor_list_op(call: _OpCall) -> bool:
    return is_list_op(call.func)


# ---------------------------------------------------------------------------------------------
# Layout checks and errors
# ---------------------------------------------------------------------------------------------

_FULL_TENSOR_HINT = (
    "call .full_tensor() to work on the whole tensor, "
    'or compile the model with torch.compile(..., backend="vescale")'
)


def _op_name(func) -> str:
    return f"aten.{func._schema.name.split('::')[-1]}.{func._overloadname}"


def _shared_spec(func, values: Sequence[Any]) -> RaggedSpec | None:
    """The one layout of the RaggedShard tensors in ``values``; raise if layouts mix.

    Plain tensors may join only as 0-dim scalars: a plain tensor with dims has no piece to pair
    with this rank's piece.
    """
    spec = first = None
    for value in values:
        if isinstance(value, RaggedShardTensor):
            if spec is None:
                spec, first = value._spec, value
            elif value._spec is not spec and value._spec != spec:
                raise ValueError(
                    f"{_op_name(func)}: cannot combine RaggedShard tensors of different layouts "
                    f"({spec.describe()} vs {value._spec.describe()}); redistribute one to the other's placement"
                )
    if spec is not None:
        for value in values:
            if isinstance(value, torch.Tensor) and not isinstance(value, RaggedShardTensor) and value.dim() != 0:
                raise ValueError(
                    f"{_op_name(func)}: cannot combine a RaggedShardTensor ({_describe(first)}) with a plain "
                    f"tensor of shape {tuple(value.shape)}; only Python scalars and 0-dim tensors mix with "
                    f"RaggedShard pieces. Shard it first (distribute_tensor with the same placement) "
                    f"or {_FULL_TENSOR_HINT}"
                )
    return spec


def _unsupported(call: _OpCall) -> NotImplementedError:
    layouts = "; ".join(_describe(t) for t in call.leaves if isinstance(t, RaggedShardTensor))
    return NotImplementedError(
        f"{_op_name(call.func)} is not supported on RaggedShardTensor ({layouts}). Each rank holds only a flat "
        f"range of the tensor, so eagerly only elementwise ops, optimizer (_foreach_/_fused_) ops and full "
        f"reductions run on the pieces; {_FULL_TENSOR_HINT}"
    )


def _describe(t: RaggedShardTensor) -> str:
    """A piece's layout, led by its parameter's name when it is a sharded parameter."""
    return f"parameter {bucket_of(t)[1]!r}: {t._spec.describe()}" if is_sharded(t) else t._spec.describe()


def _unwrap(tree: Any) -> Any:
    """``tree`` with every RaggedShardTensor replaced by its local piece."""
    return _replaced(tree, _piece)


def _piece(t: RaggedShardTensor) -> torch.Tensor:
    return t.piece


def _replaced(tree: Any, replace: Callable[[RaggedShardTensor], torch.Tensor]) -> Any:
    """``tree`` with every RaggedShardTensor ``t`` replaced by ``replace(t)``.

    Arguments shaped like the optimizer's and the model's (tensors, lists of tensors, scalars, one level of
    nesting) are walked directly: pytree's generic walk costs more than the elementwise kernels of a small
    model's optimizer step, and more than the dispatch itself of an eager model op.
    """
    if isinstance(tree, RaggedShardTensor):
        return replace(tree)
    if type(tree) is torch.Size:
        return tree
    if type(tree) is list:
        return [_replaced(x, replace) if isinstance(x, (RaggedShardTensor, list)) else x for x in tree]
    if type(tree) is tuple:
        return tuple(_replaced(x, replace) if isinstance(x, (RaggedShardTensor, list, tuple, dict)) else x
                     for x in tree)
    if type(tree) is dict:
        return {k: _replaced(v, replace) if isinstance(v, (RaggedShardTensor, list, tuple, dict)) else v
                for k, v in tree.items()}
    return tree_map_only(RaggedShardTensor, replace, tree)


# ---------------------------------------------------------------------------------------------
# Tracing and collectives: ops that see whole tensors
# ---------------------------------------------------------------------------------------------


def _run_on_full_shape_stand_ins(call: _OpCall) -> Any:
    """Shape propagation while Dynamo traces a model whose parameters are already sharded.

    Dynamo records the torch-level call (``F.linear(x, weight)``) and only needs output metadata; the
    vescale backend then replaces every parameter use by a view of the gathered bucket, so these
    stand-ins never reach a compiled graph. Only fake pieces take this path: real data still raises.
    """
    return call.run_with_replaced(lambda t: t.piece.new_empty(t.shape, dtype=t.dtype))


def _collective_on_whole_tensors(call: _OpCall) -> Any:
    """A collective over *another* mesh dim, e.g. a tensor-parallel DTensor's ``full_tensor()`` of its
    RaggedShard local tensor: gather the whole local tensor over this tensor's own dim first."""
    return call.run_with_replaced(lambda t: t.full_tensor())


# ---------------------------------------------------------------------------------------------
# Elementwise ops run on the pieces
# ---------------------------------------------------------------------------------------------


def _run_elementwise(call: _OpCall) -> Any:
    spec = _shared_spec(call.func, call.leaves)
    out = call.run_on_pieces()
    return _with_outputs_wrapped(call, out, lambda piece: _wrap_piece(call.func, piece, spec))


def _run_per_list_entry(call: _OpCall) -> Any:
    """``_foreach_*`` / fused optimizer ops: entry ``i`` of every list argument must share a layout.

    Elementwise ones run once per run of neighbouring pieces of a bucket, not once per entry
    ([Note: one kernel per bucket] in tensor/flat_buffers.py)."""
    func, bound = call.func, call.bound
    if _has_dtensor_entries(bound):
        return split_off_dtensor_entries(func, bound)
    runs = flat_buffers.plan_runs(func, bound) if flat_buffers.is_coalescible(func) else None
    joined = () if runs is None else runs.joined  # entries whose layout their slot already fixes
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
        runs.tensor(i)._spec if i in joined
        else _shared_spec(func, [values[i] for values in lists if i < len(values)] + scalars)
        for i in range(entries)
    ]
    if joined and scalars:  # the operands every entry shares must still be 0-dim
        _shared_spec(func, [runs.tensor(next(iter(joined)))] + scalars)
    if runs is None:
        out = call.run_on_pieces()
    else:  # [Note: one kernel per bucket]
        out = runs.run()
        if func._schema.is_mutable:
            call.count_writes()
    return _with_outputs_wrapped(call, out, lambda pieces: [
        RaggedShardTensor(p, s) if i in joined else _wrap_piece(func, p, s)  # a joined piece is its slot's size
        for i, (p, s) in enumerate(zip(pieces, specs))
    ])


def bind_arguments(func, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``func``'s arguments by schema name, defaults filled in."""
    return _OpCall(func, args, kwargs).bound


def _has_dtensor_entries(bound: dict[str, Any]) -> bool:
    return any(isinstance(v, (list, tuple)) and any(isinstance(t, DTensor) for t in v) for v in bound.values())


def dtensor_entries(values: Any) -> list[bool]:
    """For each entry of a list op (index ``i`` of its longest tensor lists among ``values``): whether
    the entry holds a DTensor (a tensor-parallel parameter's) or not (a RaggedShard or plain one's)."""
    lists = [v for v in values if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor)]
    entries = max(map(len, lists), default=0)
    return [any(isinstance(v[i], DTensor) for v in lists if len(v) == entries) for i in range(entries)]


def split_off_dtensor_entries(func, bound: dict[str, Any]) -> Any:
    """A list op over RaggedShard parameters and tensor-parallel DTensor ones (whose local tensors are
    RaggedShard): one call for each kind, since DTensor dispatch only takes DTensors ([Note: list ops
    mixing DTensor and RaggedShard parameters] in interop/mixed_lists.py).

    ``clip_grad_norm_`` and optimizers group gradients by device and dtype only, so the kinds mix.
    A 0-dim DTensor operand (a total norm) joins the non-DTensor call as its value.
    """
    is_dtensor = dtensor_entries(bound.values())
    entries = len(is_dtensor)
    results: list[Any] = [None] * entries
    returned = None
    for kind in (True, False):
        chosen = [i for i in range(entries) if is_dtensor[i] == kind]
        if not chosen:
            continue
        arguments = {}
        for name, value in bound.items():
            if isinstance(value, (list, tuple)) and len(value) == entries:
                value = [value[i] for i in chosen]
            elif isinstance(value, DTensor) and not kind:
                value = value.full_tensor()
            arguments[name] = value
        out = func(**arguments)
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


def _with_outputs_wrapped(call: _OpCall, out: Any, wrap: Callable[[Any], Any]) -> Any:
    """In-place and ``out=`` results are the caller's own tensors; the rest are wrapped pieces."""
    returns = call.func._schema.returns
    if not returns:
        return out
    outs = (out,) if len(returns) == 1 else tuple(out)
    results = []
    for ret, value in zip(returns, outs):
        written = _written_argument(call, ret)
        results.append(written if written is not None else wrap(value))
    return results[0] if len(returns) == 1 else tuple(results)


def _written_argument(call: _OpCall, ret) -> Any:
    alias = ret.alias_info
    if alias is None or not alias.is_write:
        return None
    for i, arg in enumerate(call.func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
            return call.args[i] if i < len(call.args) else call.kwargs[arg.name]
    return None


def _copy_(call: _OpCall) -> RaggedShardTensor:
    """``dst.copy_(src)``: from a same-layout RaggedShard tensor, a 0-dim scalar, or the full tensor."""
    func, bound = call.func, call.bound
    dst, src = bound["self"], bound["src"]
    if not isinstance(dst, RaggedShardTensor):
        raise NotImplementedError(
            f"{_op_name(func)}: copying a RaggedShardTensor ({src._spec.describe()}) into a plain tensor of shape "
            f"{tuple(dst.shape)} needs the whole tensor: copy from .full_tensor() instead"
        )
    if isinstance(src, RaggedShardTensor):
        _shared_spec(func, [dst, src])
        piece = src.piece
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
    aten.copy_.default(dst.piece, piece, bound["non_blocking"])
    call.count_writes()
    return dst


# ---------------------------------------------------------------------------------------------
# Full reductions = reduce the piece, then all-reduce over the mesh dim
# ---------------------------------------------------------------------------------------------


def _require_full_reduction(call: _OpCall) -> None:
    x, dim = call.bound["self"], call.bound.get("dim")
    if dim is None:
        return
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims or {d % max(x.dim(), 1) for d in dims} == set(range(max(x.dim(), 1))):
        return
    raise _unsupported(call)


def _keep_dims(result: torch.Tensor, x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    return result.reshape([1] * x.dim()) if keepdim else result


def _vector_norm(call: _OpCall) -> torch.Tensor:
    _require_full_reduction(call)
    bound = call.bound
    x = bound["self"]
    norm = _global_norms([x], bound["ord"], bound["dtype"])[0]
    return _keep_dims(norm, x, bound["keepdim"])


def _foreach_norm(call: _OpCall) -> list[torch.Tensor]:
    """Per-tensor global norms, with one all-reduce per process group (not one per tensor)."""
    tensors, ord, dtype = call.bound["self"], call.bound["ord"], call.bound["dtype"]
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
        (len(tensors),), math.inf if ord == -math.inf else 0.0, dtype=torch.float64, device=tensors[0].piece.device
    )
    held = [i for i, t in enumerate(tensors) if t.piece.numel() > 0]
    if held:
        local_norms = aten._foreach_norm.Scalar([tensors[i].piece for i in held], ord, dtype)
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


def _sum(call: _OpCall) -> torch.Tensor:
    _require_full_reduction(call)
    x = call.bound["self"]
    total = aten.sum.default(x.piece, dtype=call.bound["dtype"])
    return _keep_dims(collectives.all_reduce_(total, x._spec.group, "sum"), x, call.bound.get("keepdim", False))


def _extremum(call: _OpCall) -> torch.Tensor:
    """max/min/amax/amin over the whole tensor."""
    _require_full_reduction(call)
    x = call.bound["self"]
    if x.numel() == 0:
        return call.run_on_pieces()  # torch's own error for an empty tensor
    op = "max" if call.func.overloadpacket in (aten.max, aten.amax) else "min"
    local = x.piece
    if local.numel() == 0:
        value = torch.full((), _reduction_identity(x.dtype, op), dtype=x.dtype, device=local.device)
    else:
        value = aten.amax.default(local) if op == "max" else aten.amin.default(local)
    return _keep_dims(_all_reduce_extremum(value, x._spec.group, op), x, call.bound.get("keepdim", False))


def _reduction_identity(dtype: torch.dtype, op: str) -> float | int | bool:
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _any_or_all(call: _OpCall) -> torch.Tensor:
    """``any``/``all`` over the whole tensor (``trunc_normal_``'s rejection loop asks ``mask.any()``)."""
    _require_full_reduction(call)
    x = call.bound["self"]
    is_any = call.func.overloadpacket is aten.any
    local = (aten.any.default if is_any else aten.all.default)(x.piece).to(torch.int32)
    verdict = collectives.all_reduce_(local, x._spec.group, "max" if is_any else "min")
    return _keep_dims(verdict.to(torch.bool), x, call.bound.get("keepdim", False))


def _dot(call: _OpCall) -> torch.Tensor:
    spec = _shared_spec(call.func, call.args[:2])
    return collectives.all_reduce_(call.run_on_pieces(), spec.group, "sum")


def _fill_randomly(call: _OpCall) -> RaggedShardTensor:
    """``normal_``, ``uniform_`` and the other in-place random fills (``torch.nn.init``'s building blocks).

    Every rank draws the whole tensor from the same generator and keeps its piece, so each element
    gets the value one process's init of the whole tensor gives it, and the generator ends in the
    same state on every rank as in one process. Costs one whole tensor of memory while it runs.
    """
    dst = call.args[0]
    if not isinstance(dst, RaggedShardTensor) or any(isinstance(t, RaggedShardTensor) for t in call.leaves[1:]):
        raise _unsupported(call)
    whole = torch.empty(dst.shape, dtype=dst.dtype, device=dst.piece.device)
    call.func(whole, *call.args[1:], **call.kwargs)
    start, end = dst._spec.local_range
    aten.copy_.default(dst.piece, whole.view(-1)[start:end])
    call.count_writes()
    return dst


def _part(x: RaggedShardTensor, start: int, end: int, shape: Sequence[int]) -> RaggedShardTensor:
    """Flat elements ``[start, end)`` of ``x`` as a RaggedShard tensor of ``shape`` (a view of the piece)."""
    spec = x._spec
    if (start, end) == (0, x.numel()) and tuple(shape) == tuple(spec.shape):
        return RaggedShardTensor(x.piece, spec)  # the same tensor: an alias (DTensor.to_local's view_as)
    if spec.global_shape is not None:
        raise NotImplementedError(
            f"cannot split or reshape the RaggedShard local tensor of a tensor/expert-parallel DTensor "
            f"({spec.describe()}); {_FULL_TENSOR_HINT}"
        )
    held_start, held_end = spec.local_range  # this rank's piece in the flat tensor
    a, b = (min(max(v, held_start), held_end) for v in (start, end))
    placement = spec.placement if (start, end) == (0, x.numel()) else spec.placement.sub_range(start, end)
    piece = x.piece[a - held_start:b - held_start]
    return RaggedShardTensor(piece, RaggedSpec(torch.Size(shape), placement, spec.mesh, spec.mesh_dim))


def _view(call: _OpCall) -> RaggedShardTensor:
    x, size = call.args[0], list(call.args[1])
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = x.numel() // known if known else 0
    if math.prod(size) != x.numel():
        raise RuntimeError(
            f"shape {size} is invalid for a RaggedShardTensor of {x.numel()} elements ({x._spec.describe()})"
        )
    return _part(x, 0, x.numel(), size)


def _rows(call: _OpCall) -> Any:
    """``split``/``split_with_sizes``/``slice``/``unbind`` along dim 0 (``chunk`` and ``narrow`` arrive as these)."""
    func, x = call.func, call.args[0]
    dim = call.bound.get("dim", 0)
    if x.dim() == 0 or dim % x.dim() != 0 or (func is aten.slice.Tensor and call.bound.get("step", 1) != 1):
        raise _unsupported(call)
    rows, row = x.shape[0], x.numel() // max(x.shape[0], 1)
    if func is aten.slice.Tensor:
        start, end = call.bound.get("start") or 0, call.bound.get("end")
        start, end = [min(max(v + rows if v < 0 else v, 0), rows) for v in (start, rows if end is None else end)]
        return _part(x, start * row, max(start, end) * row, (max(end - start, 0), *x.shape[1:]))
    if func is aten.unbind.int:
        return tuple(_part(x, i * row, (i + 1) * row, x.shape[1:]) for i in range(rows))
    sizes = call.bound["split_sizes"] if func is aten.split_with_sizes.default else [
        min(call.bound["split_size"], rows - i) for i in range(0, rows, call.bound["split_size"])]
    parts, start = [], 0
    for n in sizes:
        parts.append(_part(x, start * row, (start + n) * row, (n, *x.shape[1:])))
        start += n
    return parts


_FLAT_ORDER_OPS: dict[Any, Callable[[_OpCall], Any]] = {
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.split.Tensor: _rows,
    aten.split_with_sizes.default: _rows,
    aten.slice.Tensor: _rows,
    aten.unbind.int: _rows,
}


def _detach(call: _OpCall) -> RaggedShardTensor:
    """A new wrapper around the same piece. Pieces never require grad, and sharing the piece keeps
    one version counter per bucket shard: writes through ``p.data`` or ``p.detach()`` count too.

    A detached sharded parameter stays in its bucket: activation checkpointing (non-reentrant) saves
    ``p.detach()`` and recomputes the forward with it eagerly, which gathers it like the parameter
    ([Note: eager calls on sharded parameters])."""
    t = call.bound["self"]
    out = RaggedShardTensor(t.piece, t._spec)
    if not call.pieces_are_fake:  # state_dict() values are detached parameters: messages still name them
        if is_sharded(t):
            out.__dict__[BUCKET_ATTR] = t.__dict__[BUCKET_ATTR]
        name = bucket_of(t)[1] if is_sharded(t) else t.__dict__.get(PARAMETER_NAME)
        if name is not None:
            out.__dict__[PARAMETER_NAME] = name
    return out


def _new_tensor(call: _OpCall) -> torch.Tensor:
    """``p.new_empty(shape)`` and its kin: a plain tensor of the given shape, with the piece's dtype
    and device (the op reads nothing else of ``p``; model inits build whole tensors this way)."""
    return call.func(call.bound["self"].piece, *call.args[1:], **call.kwargs)


_SPECIAL_HANDLERS: dict[Any, Callable[[_OpCall], Any]] = {
    aten.copy_.default: _copy_,
    aten.detach.default: _detach,
    aten.new_empty.default: _new_tensor,
    aten.new_empty_strided.default: _new_tensor,
    aten.new_zeros.default: _new_tensor,
    aten.new_ones.default: _new_tensor,
    aten.new_full.default: _new_tensor,
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
    aten.any.default: _any_or_all,
    aten.all.default: _any_or_all,
    **{getattr(packet, overload): _fill_randomly
       for packet in (aten.normal_, aten.uniform_, aten.bernoulli_, aten.exponential_, aten.log_normal_,
                      aten.cauchy_, aten.geometric_, aten.random_)
       for overload in packet.overloads()},
}
