"""Eager forward and backward of a ``fully_shard``-ed module unit: whole parameters swapped in, one gather per bucket.

[Note: eager module units]
Code that runs eagerly on sharded parameters works op by op ([Note: eager calls on sharded parameters] in
eager/calls.py): every op on a RaggedShard parameter goes through ``__torch_dispatch__``, and every
parameter's gradient through a tensor hook. A module given to :func:`fsdp_pass.fully_shard` (a *unit*:
FSDP2's parameter group) does better when it is called eagerly, as FSDP2's hooks do it, on DBuffers:

* each bucket of the call belongs to the innermost submodule whose subtree holds all its parameters (the
  call's module, or a block of a whole model given to one ``fully_shard``), raised through wrappers that hold
  nothing more (an activation-checkpoint wrapper); that submodule is the unit. A wrapper's unit gathers
  outside the checkpointed call, and its recompute in backward runs on the gather before the unit's backward
  ([Note: a wrapper unit's recompute]);
* before its forward (a forward pre-hook), each of the unit's own buckets is all-gathered, once, and its
  parameters' entries in their modules' ``_parameters`` become the whole tensors, views of the gathered
  buffer: the unit's ops run on plain tensors, with no dispatch. The trainable ones come out of one
  autograd function (:class:`_WholeParameters`) whose inputs are the sharded parameters;
* after its forward (a forward hook) the sharded parameters go back, and with ``reshard_after_forward``
  the gathered buffer's storage is freed. What autograd saved of the whole tensors (views of that buffer)
  is filled again before the unit's backward: the unit's outputs pass through :class:`_BeforeBackward`,
  whose backward gathers the buckets again into the same storage. A root's outermost call (a unit whose
  module holds other buckets, its blocks) keeps them: its forward ends the model's and the backward reads
  them first, as FSDP2 keeps its root's (``reshard_after_forward=None``) and a compiled graph its last
  bucket (``reshard_last_bucket`` in docs/options.md);
* the unit's backward hands :class:`_WholeParameters` every whole gradient at once; they join the bucket's
  unreduced sum as an eager call's gradients do (``DBuffer.add_pending``: freezing, ``no_sync``, the
  early reduction agreed by every rank, [Note: an eager bucket's gradient is reduced once every rank has
  it] in buckets/dbuffer.py), and no gradient is returned to the sharded parameters: their ``.grad`` are
  the views the reduction attaches.

Every rank calls each unit's forward (its gathers are collectives), and the backward reaches each
unit's outputs on every rank, so the gathers are matched across ranks even where ranks run different
experts inside a unit. Inside a compiled graph the hooks do nothing: the graph gathers its own buckets
(compile/passes/rewrite.py). The op-by-op path stays for parameters used outside their unit's forward
(a weight tied to another unit, a submodule called on its own), for a unit whose parameters a compiled
submodule holds (``block.mlp.compile()``: that graph reads them sharded), for units whose parameters are
tensor/expert-parallel DTensors, and for buckets whose modules no one calls as a whole (blocks merged into one
bucket under a ``ModuleList``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..buckets.dbuffer import DBuffer, before_eager_gather, buffers_of, gather_in_backward, note_eager_backward
from ..buckets.whole_values import gathered_views

__all__ = ["register_unit"]

_UNIT_ATTR = "_fsdp_pass_unit"  # a unit module's _Unit, in its __dict__
_RECOMPUTED_ATTR = "_fsdp_pass_recomputed_unit"  # on the module a wrapper unit's checkpoint recomputes: that _Unit
_running: list[_UnitCall] = []  # the unit forwards running now, outermost first


class _Unit:
    """What a unit's hooks need, kept on the module (in its ``__dict__``, as :data:`_UNIT_ATTR`)."""

    def __init__(self, module: nn.Module, buckets: list[DBuffer], wrapped: nn.Module | None) -> None:
        self.buckets = buckets  # the unit's own buckets, in layout order
        # the innermost module holding the same parameters, when the unit is a wrapper around it (an activation
        # checkpoint's, which recomputes it in backward: [Note: a wrapper unit's recompute])
        self.wrapped = wrapped
        self.recomputing: _Recompute | None = None  # what a recompute of ``wrapped`` in the running backward reads
        own = {id(p): (buf, name) for buf in buckets for name, p in buf.params.items()}
        # (module holding it, attribute, bucket, name) for every entry of a unit parameter, shared ones each time
        self.entries: list[tuple[nn.Module, str, DBuffer, str]] = [
            (sub, attr, *own[id(p)]) for sub in module.modules() for attr, p in sub._parameters.items()
            if p is not None and id(p) in own]
        self.calls: list[_UnitCall] = []  # forwards running now (a unit may call itself)
        # a root: its module holds other buckets (blocks sharded before it), so its forward ends the model's
        self.encloses_buckets = len(buffers_of(module)) > len(buckets)


class _Recompute(NamedTuple):
    """What the recompute of a wrapper unit's module reads ([Note: a wrapper unit's recompute])."""

    call: _UnitCall  # the unit call whose backward runs now
    wholes: dict  # (bucket id, name) → the whole tensor the recompute's modules hold


class _UnitCall:
    """One forward of a unit: its gathered buffers, from its forward to its backward."""

    def __init__(self, unit: _Unit) -> None:
        self.unit = unit
        self.gathered: dict[int, torch.Tensor] = {}  # id(bucket) → its gathered global buffer (m·S)
        self.freed = False  # the buffers' storage was freed after forward
        # kept after forward: the outermost unit call of a root, whose buckets the backward reads first
        self.keeps = unit.encloses_buckets and not _running

    def gather(self) -> dict[tuple[int, str], torch.Tensor]:
        """Gather every bucket of the unit; every parameter's whole tensor, by ``(bucket id, name)``."""
        # A forward recomputed inside backward (activation checkpointing) runs the forward's ops and no more: no
        # agreement (selective checkpointing refuses an op its forward did not run, such as the flags' tensor)
        before = before_eager_gather if torch._C._current_graph_task_id() == -1 else _no_agreement
        wholes = {}
        for buf in self.unit.buckets:
            self.gathered[id(buf)], views = gathered_views(buf, before)
            wholes.update({(id(buf), name): view for name, view in views.items()})
        return wholes

    def free(self) -> None:
        if self.keeps:
            return
        for buf in self.unit.buckets:
            if buf.reshard_after_forward is not False:
                self.gathered[id(buf)].untyped_storage().resize_(0)
                self.freed = True

    @torch.no_grad()
    def gather_again(self) -> None:
        """Fill the freed buffers again, before the unit's backward reads what it saved of them."""
        if not self.freed:
            return
        self.freed = False
        for buf in self.unit.buckets:
            target = self.gathered[id(buf)]
            if target.untyped_storage().nbytes() > 0:
                continue
            target.untyped_storage().resize_(target.numel() * target.element_size())
            with torch.autograd._unsafe_preserve_version_counter(target):  # saved views of it stay valid
                gather_in_backward(buf, target)


def _no_agreement(buf: DBuffer) -> None:
    """What a recomputed forward's gather runs first: nothing (the ranks recompute alike, so none agrees there)."""


class _WholeParameters(torch.autograd.Function):
    """The unit's trainable parameters (sharded) → their whole tensors; backward: into the buckets' sums."""

    @staticmethod
    def forward(ctx, call: _UnitCall, keys: tuple, wholes: tuple, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call, ctx.keys = call, keys
        ctx.set_materialize_grads(False)  # a parameter no path reached gets None, not zeros: it is not reached
        return tuple(w.view_as(w) for w in wholes)

    @staticmethod
    @torch.no_grad()
    def backward(ctx, *grads: torch.Tensor | None):
        wholes: dict[int, dict[str, torch.Tensor]] = {id(buf): {} for buf in ctx.call.unit.buckets}
        for (bucket_id, name), grad in zip(ctx.keys, grads):
            if grad is not None:
                wholes[bucket_id][name] = grad.reshape(-1)
        for buf in ctx.call.unit.buckets:
            # frozen since its forward: one process adds nothing to it
            trainable = {name: g for name, g in wholes[id(buf)].items() if buf.params[name].requires_grad}
            if trainable:
                buf.add_pending(trainable)
        ctx.call.gathered.clear()  # what the unit's backward saved keeps the buffers alive as long as it needs
        return (None, None, None) + (None,) * len(grads)  # the sharded parameters' .grad are the reduction's views


class _BeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward gathers the unit's buckets again (they were freed after forward)."""

    @staticmethod
    def forward(ctx, call: _UnitCall, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        note_eager_backward()  # [Note: an eager bucket's gradient is reduced once every rank has it]
        call = ctx.call
        call.gather_again()
        if call.unit.wrapped is not None and call.gathered:  # [Note: a wrapper unit's recompute]; a second
            # backward through the call (retain_graph) finds its gather handed on and recomputes op by op
            views = {(id(buf), name): view for buf in call.unit.buckets
                     for name, view in buf.views(call.gathered[id(buf)]).items()}
            with torch.enable_grad():
                call.unit.recomputing = _Recompute(call, _whole_tensors(call, views))
            # a backward that never enters the checkpointed call recomputes nothing: let go of the gather then
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _forget_recompute(call))
        return (None,) + grads


def _whole_tensors(call: _UnitCall, wholes: dict[tuple[int, str], torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """The unit's whole tensors (``wholes``: views of its gathered buffers, by ``(bucket id, name)``), the trainable
    ones through :class:`_WholeParameters` when grad is enabled."""
    trainable = {}  # (bucket id, name) → the sharded parameter, once each (a shared one has several entries)
    if torch.is_grad_enabled():
        trainable = {(id(buf), name): buf.params[name] for _, _, buf, name in call.unit.entries
                     if buf.params[name].requires_grad}
    if trainable:
        keys = tuple(trainable)
        outs = _WholeParameters.apply(call, keys, tuple(wholes[k] for k in keys), *trainable.values())
        wholes.update(zip(keys, outs))
    return wholes


def _swap_in(unit: _Unit, wholes: dict[tuple[int, str], torch.Tensor]) -> None:
    """Put the unit's whole tensors (by ``(bucket id, name)``) in its modules' ``_parameters``."""
    for sub, attr, buf, name in unit.entries:
        sub._parameters[attr] = wholes[(id(buf), name)]


def _swap_out(unit: _Unit) -> None:
    """Give the unit's modules their sharded parameters back."""
    for sub, attr, buf, name in unit.entries:
        sub._parameters[attr] = buf.params[name]


def _before_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():
        return None
    unit: _Unit | None = module.__dict__.get(_UNIT_ATTR)
    if unit is None or _under_compiled(module, unit):
        return None
    if unit.wrapped is not None and torch.is_grad_enabled() and _RECOMPUTED_ATTR not in unit.wrapped.__dict__:
        _watch_recompute(unit)
    unit.recomputing = None
    call = _UnitCall(unit)
    _swap_in(unit, _whole_tensors(call, call.gather()))
    unit.calls.append(call)
    _running.append(call)
    return None


# [Note: a wrapper unit's recompute]
# A unit raised to an activation-checkpoint wrapper (:func:`_owner`) gathers around the checkpointed call, and
# the recompute inside backward calls the wrapped module, not the wrapper: its hooks do not run, so the
# recompute would find the sharded parameters and run op by op, gathering each bucket a second time. So the
# wrapped module gets hooks of its own that act only inside a backward, between the wrapper's
# :class:`_BeforeBackward` and the end of the recompute: they swap in the whole tensors of the gather before the
# unit's backward, as the wrapper's forward did. :class:`_BeforeBackward` makes them (``_Unit.recomputing``),
# through :class:`_WholeParameters` with grad enabled: a reentrant checkpoint backpropagates through the
# recompute itself, a non-reentrant one only reads what the recompute saves. Made there, not in the recompute,
# they run no op inside it (selective checkpointing refuses an op its forward did not run); the backward's end
# lets go of them, whether or not a recompute read them. The hooks are added at the wrapper's first eager call
# with grad enabled, not when it is sharded: a wrapper compiled from its first call never gets them, and hooks
# inside a compiled wrapper would make Dynamo guard each block's hook ids and compile a graph per block. A
# module raised through a container (``experts`` of an MoE layer, a ``ModuleList`` no one calls) wraps nothing.
def _watch_recompute(unit: _Unit) -> None:
    unit.wrapped.__dict__[_RECOMPUTED_ATTR] = unit
    unit.wrapped.register_forward_pre_hook(_before_recompute, with_kwargs=True)
    unit.wrapped.register_forward_hook(_after_recompute, with_kwargs=True, always_call=True)


def _before_recompute(module: nn.Module, args: tuple, kwargs: dict) -> None:
    unit: _Unit = module.__dict__[_RECOMPUTED_ATTR]
    if unit.recomputing is not None and not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        _swap_in(unit, unit.recomputing.wholes)
    return None


def _forget_recompute(call: _UnitCall) -> None:
    if call.unit.recomputing is not None and call.unit.recomputing.call is call:
        call.unit.recomputing = None


def _after_recompute(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    unit: _Unit = module.__dict__[_RECOMPUTED_ATTR]
    if unit.recomputing is not None and torch._C._current_graph_task_id() != -1:
        unit.recomputing = None
        _swap_out(unit)
    return None


def _runs_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s calls run compiled: ``torch.compile(module)``'s wrapper or ``module.compile()``."""
    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def _under_compiled(module: nn.Module, unit: _Unit) -> bool:
    """Whether a parameter of ``unit`` lives in a compiled submodule of ``module``, whose graph reads it sharded
    (checked at each call: ``block.compile()`` usually comes after ``fully_shard``)."""
    compiled = {id(m) for sub in module.modules() if sub is not module and _runs_compiled(sub) for m in sub.modules()}
    return bool(compiled) and any(id(sub) in compiled for sub, _, _, _ in unit.entries)


def _after_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    if torch.compiler.is_compiling():
        return None
    unit: _Unit | None = module.__dict__.get(_UNIT_ATTR)
    if unit is None or not unit.calls:
        return None
    call = unit.calls.pop()
    _running.remove(call)
    _swap_out(unit)
    if output is None or not torch.is_grad_enabled():  # None also when the forward raised (always_call)
        return None
    leaves, spec = tree_flatten(output)
    at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not at:
        return None
    if torch._C._current_graph_task_id() == -1:  # not a recompute inside a backward (activation checkpointing),
        call.free()  # whose saved tensors are read before any _BeforeBackward of its own would gather them again
    passed = _BeforeBackward.apply(call, *(leaves[i] for i in at))
    for i, t in zip(at, passed):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def register_unit(module: nn.Module, buckets: list[DBuffer]) -> None:
    """Make units of ``module``'s new ``buckets`` ([Note: eager module units]): each bucket belongs to the
    innermost submodule of ``module`` whose subtree holds all its parameters, raised through wrappers holding
    nothing more (:func:`_owner`), and each such owner becomes a unit over its buckets. Buckets of
    tensor/expert-parallel DTensors keep the op-by-op path, and so does an owner that is a unit already, or a
    container (``ModuleList``, ``ModuleDict``) no one calls."""
    by_owner: dict[int, tuple[nn.Module, list[DBuffer]]] = {}
    holders = _holders(module)
    for buf in buckets:
        if buf.dtensor_specs:
            continue
        owner, wrapped = _owner(module, [holders[id(p)] for p in buf.params.values()])
        by_owner.setdefault(id(owner), (owner, wrapped, []))[2].append(buf)
    for owner, wrapped, owned in by_owner.values():
        if _UNIT_ATTR in owner.__dict__ or isinstance(owner, (nn.ModuleList, nn.ModuleDict)):
            continue
        owner.__dict__[_UNIT_ATTR] = _Unit(owner, owned, wrapped)
        owner.register_forward_pre_hook(_before_forward, with_kwargs=True)
        owner.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)  # the shards go back even
        # if the forward raises


def _holders(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) → the qualified names of the modules under ``module`` holding it (several when shared)."""
    held: dict[int, list[str]] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for p in sub._parameters.values():
            if p is not None:
                held.setdefault(id(p), []).append(path)
    return held


def _owner(module: nn.Module, holders: list[list[str]]) -> tuple[nn.Module, nn.Module | None]:
    """The submodule of ``module`` whose calls are a unit for parameters held by ``holders``: the innermost one
    whose subtree contains every holder (the whole model gives a bucket per block its block; the norm and head of
    a root the root), raised through wrappers that hold nothing else (an activation-checkpoint wrapper, which
    ``block.compile()`` then compiles: hooks on a module inside a compiled one would be guarded per block, a
    graph each). Also the module raised from, when the owner is a wrapper that calls it (else None)."""
    paths = [path.split(".") if path else [] for names in holders for path in names]
    common = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(common), len(path)) and common[n] == path[n]:
            n += 1
        common = common[:n]
    innermost = owner = module.get_submodule(".".join(common))
    own = {id(p) for p in owner.parameters()}
    while common:
        parent = module.get_submodule(".".join(common[:-1]))
        if isinstance(parent, (nn.ModuleList, nn.ModuleDict)) or {id(p) for p in parent.parameters()} != own:
            break  # a container no one calls, or a module holding more
        common, owner = common[:-1], parent
    wraps = owner is not innermost and not isinstance(innermost, (nn.ModuleList, nn.ModuleDict))  # a container is
    # never called: its parent calls its children
    return owner, (innermost if wraps else None)
