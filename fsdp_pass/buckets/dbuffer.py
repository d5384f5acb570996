"""DBuffer: the flat, persistent buffers behind one bucket of parameters.

Rank ``r`` owns ``[r*S, (r+1)*S)`` of the bucket's global buffer, and every parameter is one
contiguous slice of that global buffer (the planner's layout). So:

* the all-gather output *is* the unsharded parameter set: each parameter is a view of it (no
  copy-out), and the local shard is exactly this rank's slice of it (no copy-in);
* the reduce-scatter input is the gradient set in the same layout, and its output is the gradient
  shard; each parameter's ``.grad`` is a RaggedShard view of that one shard;
* whole-bucket operations (``zero_``, ``mul_``, ``add_``, ``copy_``) are one kernel on the shard.

[Note: gradient shard lifetime]
Autograd accumulates a bucket's reduced gradient into ``shard.grad`` (the shard is the autograd
leaf). Right after, the post-accumulate hook points every parameter's ``.grad`` at its view of that
buffer and takes it off ``shard.grad``: from then on only the parameters' views hold it, so
``optimizer.zero_grad(set_to_none=True)`` frees it at once, not at the next step. When the next
gradient reaches the shard, a pre-hook puts the live buffer back on ``shard.grad`` (pieces of
parameters whose ``.grad`` was cleared are zeroed first) so autograd accumulates in place; if no
parameter holds a view any more, the new gradient becomes the buffer without a copy. Checking at
that moment, not at the forward, also makes ``zero_grad`` between forward and backward exact.

[Note: gradient accumulation without sync]
``fsdp_pass.no_sync(model)`` / ``set_requires_gradient_sync(model, False)`` clear
:attr:`DBuffer.gradient_sync`. While any trainable bucket of a compiled graph is not syncing, or
still holds an accumulated gradient, the backend runs another compiled variant of the same
rewritten graph (compile/passes/rewrite.py :func:`hand_out_gradients`, compiled once, on first use): each
trainable bucket's ``gather_bucket`` there also takes a *pending* input, an autograd leaf of the
gathered size (m·S elements in ``reduce_dtype``; a stride-0 view of one element, so the leaf itself
costs nothing). Its backward reduces nothing: it hands the whole, unsharded bucket gradient to that
leaf, and autograd's gradient accumulation sums the micro-batches into ``pending.grad`` (the first
one's gradient is taken over without a copy, later ones are added in place). That one m·S buffer
per trainable bucket is the memory cost of accumulating.

The first backward that runs with ``gradient_sync`` set again (the last micro-batch, still on the
variant since a gradient is pending) flushes: the leaf's post-accumulate-grad hook queues an
end-of-backward callback that reduce-scatters ``pending.grad`` once (+ all-reduce over the HSDP
replicate dim, / data-parallel degree, as :class:`_GatherBucket` does), adds the result into the
gradient shard, points the parameters' ``.grad`` at it and frees the m·S buffer. So a step of k
micro-batches costs one reduce-scatter per trainable bucket instead of k. The callback runs once
per bucket per backward even if several graphs (graph breaks) use the bucket.

[Note: the gradient state of a parameter]
What one process does, and so what every path here must do: a parameter's ``.grad`` is None until a
backward *reaches* it (autograd runs its gradient accumulator: the loss depends on it); each backward that
reaches it adds into ``.grad``; ``zero_grad()`` sets it to None (``set_to_none=False``: zeros it in place);
a parameter no backward reached keeps ``.grad`` as it was, and optimizers skip one whose ``.grad`` is None
(no weight decay, no moment decay). Which forward ran is irrelevant: a forward whose loss is dropped, or
a ``zero_grad()`` between forward and backward, changes nothing a forward noted.

A bucket's reduced gradient covers all its parameters, so the bucket tracks, per trainable parameter,
the states below; every path (compiled graphs, eager calls, parameters no graph reads, per-block
compiles, accumulation without sync, the step-boundary settings) moves them through these methods only:

=========================  =====================================================  ===========================
state                      here                                                   one process
=========================  =====================================================  ===========================
no gradient                ``p.grad`` None (its piece of the gradient shard is     ``p.grad`` None
                           zeroed before the shard is accumulated into again)
gradient view attached     ``p.grad`` a RaggedShard view of the bucket's          ``p.grad`` the sum of the
                           gradient shard (the live buffer, ``_grad_ref``)         backwards since cleared
reached, not yet reduced   name in :attr:`DBuffer.reached`                         (inside backward)
pending accumulation       name in ``pending_names``; its gradient in the whole   the same sum
                           sum ``pending.grad``; ``p.grad`` a view, zero until
                           the flush ([Note: gradient accumulation without sync])
in flight                  attached view of a reduce-scatter's output, waited     —
                           when first read ([Note: the last reduce-scatter
                           overlaps the optimizer step])
=========================  =====================================================  ===========================

Events:

* *backward reaches p*: a compiled graph that read ``p`` produces the bucket's gradient (its input passes
  through :func:`note_reached`, whose backward notes the graph's names), or an eager call's hook on ``p``
  runs (eager/calls.py). Forward notes nothing.
* *the bucket's gradient is reduced* (the shard's post-accumulate hook, a flush, a deferred reduce):
  ``reached`` is agreed across the data-parallel ranks (:meth:`DBuffer.agree_reached`: a rank whose
  micro-batch skipped an expert another rank used reads a reduced gradient for it, as one process on the
  global batch does), the reduced shard is added into the live buffer (pieces of parameters with no
  gradient zeroed first), the reached parameters get views (:meth:`DBuffer.attach_grads`) and ``reached``
  empties. A parameter not reached keeps its state: None stays None, a view keeps its sum (plus zeros).
* *backward under no sync*: the whole gradient goes to ``pending.grad``; the reached names join
  ``pending_names`` and get (zero) views at once, so a ``zero_grad(set_to_none=True)`` before the flush is
  seen: the pending pieces of parameters that lost their view are zeroed before the next accumulation and
  at the flush. A write into the views meanwhile (``zero_grad(set_to_none=False)``, a clip) would miss
  the pending sum, so the flush refuses it with an error that names the parameter.
* *the first synced backward*, or any synced backward while the bucket still has a pending sum (even one
  that does not reach the bucket: the end of every backward that reduces a gradient flushes every pending
  sum whose bucket syncs, in the order the sums started, :func:`queue_flush_all`), reduces the pending sum
  once.
* *freeze / unfreeze* (``requires_grad``) is read when a graph runs forward (one process's autograd records
  no path to a frozen parameter) and when it runs backward (its gradient accumulator adds nothing to a
  parameter frozen since): a backward notes only the parameters trainable both times, and leaves the
  others' pieces out of what it adds, into the live buffer or into a pending or deferred sum
  (:func:`note_reached`; eager calls get neither gradient nor hook for a frozen parameter). What a parameter gathered while trainable stays its own: a sum reduced
  after the parameter was frozen reaches its view (the optimizer steps it, as one process's would with the
  ``.grad`` it kept), and a sum that grew while it was frozen holds nothing of it after an unfreeze.
* *zero_grad*, *optimizer step*, ``clip_grad_norm_``: act on the views as on one process's tensors.
"""

from __future__ import annotations

import weakref
from typing import Callable, Collection, Iterable, Mapping, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..placement import RaggedShard
from ..options import QuantizedReduce
from ..planner import Layout
from ..tensor import collectives, flat_buffers, in_flight
from ..tensor.ragged_tensor import BUCKET_ATTR, RaggedShardTensor, bucket_of, is_sharded, over_pieces, ragged_part
from .gather import Fp8Gather, GatherConfig, gather_bucket, reduce_gradient
from .mesh import ShardingMesh
from .whole_values import whole_views

_c10d = torch.ops._c10d_functional

__all__ = ["DBuffer", "at_end_of_backward", "buffers_of", "flush_agreed", "is_unsharded", "mark_unsharded",
           "note_eager_backward", "note_reached", "pending_leaf", "queue_flush_all"]

_UNSHARDED_ATTR = "_fsdp_pass_unsharded"  # on a parameter inside fsdp_pass.unshard: its whole value stands in


def is_unsharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a sharded parameter showing its whole value inside ``fsdp_pass.unshard``."""
    return getattr(p, _UNSHARDED_ATTR, False)


def mark_unsharded(p: torch.Tensor) -> None:
    """Flag ``p`` as :func:`is_unsharded` (the flag lives in ``p.__dict__``, which the swap back takes away)."""
    setattr(p, _UNSHARDED_ATTR, True)


def buffers_of(module: nn.Module) -> list["DBuffer"]:
    """The DBuffers holding ``module``'s sharded parameters, in parameter order (a compiled module's too)."""
    return buffers_of_parameters(module.parameters())


def buffers_of_parameters(params: Iterable[torch.Tensor]) -> list["DBuffer"]:
    """The DBuffers holding the sharded ones of ``params``, in their order."""
    found: dict[int, DBuffer] = {}
    for p in params:
        if is_sharded(p):
            buf, _ = bucket_of(p)
            found.setdefault(id(buf), buf)
    return list(found.values())


class DBuffer:
    """The flat shard of one bucket and the address map of its parameters.

    Args:
        layout: the planner's layout of the bucket (names are parameter FQNs).
        shapes: global shape of every parameter, by name (for tensor/expert-parallel DTensor
            parameters, the shape of their local tensor: that is what the bucket shards; see
            [Note: FSDP over TP/EP] in sharding/materialize.py).
        mesh: the ranks the bucket is sharded over (HSDP: sharded over one dim, replicated over the other).
        dtype, device: of the master shard (one DBuffer per dtype).
        requires_grad: whether the shard collects gradients (False for frozen parameters).
        dtensor_specs: for DTensor parameters, their DTensor spec (mesh, placements, global shape).
        fp8_tile: compiled gathers move FP8 codes + scales of ``fp8_tile``-square tiles (every
            parameter's block is whole panels of ``fp8_tile`` rows); see [Note: FP8 all-gather].
    """

    def __init__(
        self,
        layout: Layout,
        shapes: dict[str, torch.Size],
        mesh: ShardingMesh,
        dtype: torch.dtype,
        device: torch.device,
        requires_grad: bool = True,
        index: int = 0,
        dtensor_specs: dict[str, DTensorSpec] | None = None,
        fp8_tile: int | None = None,
    ) -> None:
        self.layout = layout
        self.dtensor_specs = dict(dtensor_specs or {})
        self.shapes = {n: torch.Size(shapes[n]) for n in layout.names}
        self.mesh = mesh
        self.index = index
        self.fp8_tile = fp8_tile
        self.fp8_skipped: dict[str, str] = {}  # FP8 candidates here kept in param_dtype → why (for explain())
        # parameter → why its gradient is copied into the bucket gradient, not produced there (for
        # explain(); [Note: gradients written into the bucket] in compile/passes/grad_into_bucket.py)
        self.gradient_copies: dict[str, str] = {}
        # The shard is a leaf: autograd accumulates the reduce-scattered gradient into shard.grad,
        # and parameters' .grad are views of it.
        self.shard = torch.zeros(layout.shard_size, dtype=dtype, device=device, requires_grad=requires_grad)
        mesh.node_levels()  # its process groups are made now, while the world's ranks make their buckets alike
        self.params: dict[str, nn.Parameter] = {}
        self._placements: dict[str, RaggedShard] = {}
        self._segment_index: dict[str, int] | None = None  # parameter name → segment position (segment_index)
        self._grad_ref: weakref.ref | None = None  # the gradient shard the parameters' .grad views live in
        # [Note: gradient accumulation without sync]
        self.gradient_sync = True  # False inside fsdp_pass.no_sync(model)
        self._pending: torch.Tensor | None = None  # leaf whose .grad sums the unsharded gradients
        self._pending_config: GatherConfig | None = None
        # trainable parameters whose gradient is in the pending sum ([Note: the gradient state of a parameter])
        self.pending_names: set[str] = set()
        # the gradient buffer's version counter when the pending sum's views were last attached: a write
        # into the views since then is one the pending sum missed
        self._pending_views_version: int | None = None
        self._pending_in_graph = False  # the pending leaf was handed to a compiled graph, whose backward adds to it
        # trainable parameters whose eager gradient has not yet joined the pending sum in the running backward
        # ([Note: eager calls on sharded parameters] in eager/calls.py): when none is left the bucket is reduced;
        # None before the backward's first eager gradient
        self._eager_awaited: set[str] | None = None
        # listed among the buckets whose eager sums the ranks agree on ([Note: an eager bucket's gradient is
        # reduced once every rank has it])
        self.eager_candidate = False
        # [Note: the last reduce-scatter overlaps the optimizer step] in step/deferred_reduce.py
        # (kept here, driven by step/deferred_reduce.py)
        self.deferred: torch.Tensor | None = None  # leaf whose .grad is this step's unreduced gradient (m·S)
        self.deferred_config: GatherConfig | None = None
        self.deferred_queued = False  # its reduce is queued for the end of this backward
        # Reduced gradients are divided by this (None: the data-parallel degree, a mean); see
        # fsdp_pass.set_gradient_divide_factor. Compiled graphs hold it as a constant.
        self.gradient_divide_factor: float | None = None
        # trainable parameters a backward reached since the bucket's gradient was last attached: only they
        # get new .grad views ([Note: the gradient state of a parameter])
        self.reached: set[str] = set()
        # parameters a compiled graph reads (explain(): the others run through the eager path only,
        # [Note: parameters no graph reads] in compile/passes/unread.py)
        self.compiled_reads: set[str] = set()
        # (shard version when gathered, name → whole view) of the last eager gather (buckets/whole_values.py)
        self.whole_views: tuple[int, dict[str, torch.Tensor]] | None = None
        # fully_shard's mp_policy: what graphs compiled without options["mp_policy"] gather and reduce in
        self.param_dtype: torch.dtype = dtype
        self.reduce_dtype: torch.dtype = dtype
        # fully_shard's reshard_after_forward: what graphs compiled with the default option do after forward
        # (True, False, or a node group size: [Note: reshard within a node after forward])
        self.reshard_after_forward: bool | int = True
        # what eager calls gather in: the param_dtype of the last graph compiled over the bucket, else param_dtype
        self.compute_dtype: torch.dtype = dtype
        # names of parameters still holding the NaN placeholder ([Note: uninitialized shards] in buckets/uninitialized.py)
        self.uninitialized: set[str] = set()
        # the all-gather issued for the next step, in flight (a step/prefetch.py _Prefetch; kept here,
        # driven by step/prefetch.py: [Note: the next step's first gather starts at the optimizer step])
        self.prefetched = None
        # where each parameter's piece lies in this rank's shard ([Note: one kernel per bucket] in tensor/flat_buffers.py)
        self.slots = flat_buffers.BucketSlots({n: layout.shard_range(n, self.rank) for n in layout.names})
        flat_buffers.register(self.shard, self.slots)

    # -- geometry ------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return self.layout.names

    @property
    def rank(self) -> int:
        return self.mesh.shard_rank

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    def placement(self, name: str) -> RaggedShard:
        """``name``'s RaggedShard; cached, since gradients are re-wrapped every step."""
        if name not in self._placements:
            self._placements[name] = self.layout.placement(name)
        return self._placements[name]

    def local_piece(self, name: str, source: torch.Tensor | None = None) -> torch.Tensor:
        """``name``'s piece as a 1-D view of ``source`` (default: the master shard)."""
        a, b = self.layout.shard_range(name, self.rank)
        base = self.shard.detach() if source is None else source
        return base[a:b]

    def whole_parameter(self, name: str) -> torch.Tensor:
        """``name``'s whole value for an eager op ([Note: eager calls on sharded parameters] in eager/calls.py)."""
        return whole_views(self, before_eager_gather)[name]

    def segment_sizes(self) -> list[int]:
        return [size for _, size in self.layout.segments()]

    def segment_index(self, name: str) -> int:
        """Position of ``name``'s segment among the bucket's segments (padding segments included)."""
        if self._segment_index is None:
            self._segment_index = {n: i for i, (n, _) in enumerate(self.layout.segments()) if n is not None}
        return self._segment_index[name]

    def views(self, global_buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter as a view of the gathered global buffer (no copies)."""
        pieces = torch.split(global_buffer, self.segment_sizes())
        out = {}
        for (name, _), piece in zip(self.layout.segments(), pieces):
            if name is not None:
                out[name] = piece.view(self.shapes[name])
        return out

    # -- filling and wrapping ------------------------------------------------------------------
    def adopt(self, name: str, p: nn.Parameter) -> None:
        """Record ``p`` (already swapped to its RaggedShard piece) as this bucket's parameter ``name``."""
        setattr(p, BUCKET_ATTR, (self, name))
        if isinstance(p, DTensor):  # its local piece too: eager TP code reads it ([Note: eager calls on sharded parameters])
            setattr(p._local_tensor, BUCKET_ATTR, (self, name))
        self.params[name] = p

    @torch.no_grad()
    def load_full(self, name: str, full: torch.Tensor) -> None:
        """Copy this rank's piece of the full tensor ``full`` into the shard."""
        a, b = self.layout.local_range(name, self.rank)
        self.local_piece(name).copy_(full.detach().reshape(-1)[a:b])

    def ragged(self, name: str, local: torch.Tensor, requires_grad: bool = False) -> RaggedShardTensor:
        """Wrap a 1-D local piece of parameter ``name`` as a RaggedShardTensor."""
        spec = self.dtensor_specs.get(name)
        global_shape = global_offset = None
        if spec is not None:
            global_shape = spec.shape
            _, global_offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
        return RaggedShardTensor.from_local(
            local, self.mesh.mesh, self.placement(name), self.shapes[name],
            mesh_dim=self.mesh.shard_dim, requires_grad=requires_grad,
            global_shape=global_shape, global_offset=global_offset,
        )

    def wrap(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """A 1-D piece as the parameter sees it: RaggedShard, inside the parameter's DTensor if it has one."""
        ragged = self.ragged(name, local)
        spec = self.dtensor_specs.get(name)
        return ragged if spec is None else over_pieces(ragged, spec)

    def gradient_buffer(self, create: bool = False) -> torch.Tensor | None:
        """The bucket's gradient shard (S elements), ready to accumulate into; see [Note: gradient shard lifetime].

        The buffer the parameters' ``.grad`` views live in. Pieces of parameters whose ``.grad`` was
        cleared are zeroed first. None when no parameter holds a gradient, unless ``create``: then a
        zero buffer.
        """
        grad = None if self._grad_ref is None else self._grad_ref()
        if grad is not None:
            in_flight.settle_tensor(grad)
            cleared = [name for name, p in self.params.items() if not _is_view_of(p.grad, grad)]
            if len(cleared) == len(self.params):
                grad = None
            else:
                with torch.no_grad():
                    for name in cleared:
                        self.local_piece(name, grad).zero_()
        if grad is None and create:
            grad = torch.zeros_like(self.shard, requires_grad=False)
        return grad

    def attach_grads(self, grad: torch.Tensor) -> None:
        """Point the ``.grad`` of every trainable parameter a backward reached at its view of the gradient
        shard ``grad``; the others keep theirs ([Note: the gradient state of a parameter])."""
        self._grad_ref = weakref.ref(grad)
        flat_buffers.register(grad, self.slots)  # [Note: one kernel per bucket]
        self._view_reached(grad)

    def _view_reached(self, grad: torch.Tensor, zero_new: bool = False) -> None:
        """Give every trainable parameter :attr:`reached` that is not yet viewing ``grad`` its view (its piece
        zeroed first with ``zero_new``: a piece without a view holds no gradient); empty ``reached``."""
        for name in self.reached:
            p = self.params[name]
            if not _is_view_of(p.grad, grad):
                piece = self.local_piece(name, grad)
                if zero_new:
                    piece.zero_()
                p.grad = self.wrap(name, piece)
        self.reached.clear()
        self.mark_pending_views()  # what was just added or attached is fsdp_pass's own write

    @torch.no_grad()
    def without(self, grad: torch.Tensor, names: Iterable[str], whole: bool = False) -> torch.Tensor:
        """A copy of ``grad`` (the bucket's gradient shard, or with ``whole`` the unsharded m·S gradient) with
        the pieces of parameters ``names`` zeroed."""
        grad = grad.clone()
        for name in names:
            piece = grad[slice(*self.layout.global_range(name))] if whole else self.local_piece(name, grad)
            piece.zero_()
        return grad

    def frozen(self, names: Iterable[str]) -> frozenset[str]:
        """Those of ``names`` whose parameters do not require grad now."""
        return frozenset(name for name in names if not self.params[name].requires_grad)

    def note_reached(self, names: Iterable[str]) -> None:
        """A backward reached parameters ``names`` ([Note: the gradient state of a parameter])."""
        self.reached.update(names)

    def agree_reached(self) -> None:
        """Make :attr:`reached` the union over the bucket's data-parallel ranks (one all-reduce of a byte per
        trainable parameter): the reduced gradient is every rank's, and so is whether a parameter has one."""
        groups = self.mesh.data_parallel_groups()
        if not groups:
            return
        names = self.names  # a flush's names were trainable when reached, maybe not now
        mask = torch.tensor([name in self.reached for name in names], dtype=torch.uint8, device=self.shard.device)
        for group in groups:
            mask = collectives.all_reduced(mask, group, "max")
        self.reached.update(name for name, hit in zip(names, mask.tolist()) if hit)

    @property
    def trainable_names(self) -> list[str]:
        return [name for name, p in self.params.items() if p.requires_grad]

    # -- whole-bucket operations ---------------------------------------------------------------
    @torch.no_grad()
    def zero_grad_(self) -> None:
        grad = self.gradient_buffer()
        if grad is not None:
            grad.zero_()

    @torch.no_grad()
    def scale_grad_(self, factor: float) -> None:
        grad = self.gradient_buffer()
        if grad is not None:
            grad.mul_(factor)

    # -- accumulation without sync: [Note: gradient accumulation without sync] ------------------
    @property
    def accumulating(self) -> bool:
        """Whether a trainable bucket's gradient goes to the pending buffer instead of a reduce-scatter."""
        return self.shard.requires_grad and (not self.gradient_sync or self._pending is not None)

    def pending_input(self, config: GatherConfig) -> torch.Tensor:
        """The autograd leaf whose ``.grad`` accumulates the unsharded gradient (made on first use), for a
        compiled graph's input."""
        self._pending_in_graph = True
        return self._pending_leaf(config)

    def _pending_leaf(self, config: GatherConfig) -> torch.Tensor:
        if self._pending is None:
            self._pending = self.gradient_leaf(config, _pending_accumulated)
            ref = weakref.ref(self)
            self._pending.register_hook(lambda grad, ref=ref: _before_pending_accumulates(ref))
            self._pending_config = config
            _with_pending.append(self)
        return self._pending

    @torch.no_grad()
    def add_pending(self, wholes: Mapping[str, torch.Tensor]) -> None:
        """Add eager calls' whole gradients (name → flat gradient, summed over nothing yet; the names reached)
        into the accumulated bucket gradient, which the backward that syncs reduce-scatters once ([Note:
        gradient accumulation without sync]; eager calls: [Note: eager calls on sharded parameters] in
        eager/calls.py, [Note: eager module units] in eager/units.py)."""
        self.note_reached(wholes)
        leaf = self._pending_leaf(self._pending_config or self.config(self.param_dtype, self.reduce_dtype))
        if leaf.grad is None:
            leaf.grad = torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        else:  # no .grad is cleared between two gradients of one backward: look for them at its first only
            self._settle_pending_views(look_for_cleared=self._eager_awaited is None)
        for name, whole in wholes.items():
            lo, hi = self.layout.global_range(name)
            leaf.grad[lo:hi].add_(whole.to(leaf.dtype))
        _pending_accumulated(weakref.ref(self))
        if self._eager_awaited is None:  # this backward's first eager gradient
            self._eager_awaited = set(self.trainable_names)
            at_end_of_backward(weakref.ref(self), _end_eager_backward)
            note_eager_backward()
        self._eager_awaited.difference_update(wholes)  # [Note: an eager bucket's gradient is reduced once every
        # rank has it]

    @property
    def _reached_all(self) -> bool:
        """Whether every parameter of the bucket has its gradient in the sum about to be reduced."""
        return self.pending_names.union(self.reached).issuperset(self.names)

    @property
    def _eager_complete(self) -> bool:
        """Whether every trainable parameter's eager gradient arrived in this backward, and the sum may be reduced
        now: it syncs, and no compiled graph may still add to it."""
        return (self._eager_awaited is not None and not self._eager_awaited and self.gradient_sync
                and not self._pending_in_graph)

    def gradient_leaf(self, config: GatherConfig, on_gradient) -> torch.Tensor:
        """A :func:`pending_leaf` whose post-accumulate-grad hook calls ``on_gradient(weakref to self)``."""
        leaf = pending_leaf(self, config)
        ref = weakref.ref(self)  # hooks live in C++: a strong reference would keep the model alive
        leaf.register_post_accumulate_grad_hook(lambda _, ref=ref: on_gradient(ref))
        return leaf

    @property
    def pending_bytes(self) -> int:
        """Bytes held by the accumulated, not yet reduced gradient (0 when none)."""
        grad = None if self._pending is None else self._pending.grad
        return 0 if grad is None else grad.numel() * grad.element_size()

    @torch.no_grad()
    def _hold_pending_views(self) -> None:
        """The parameters this backward reached have their gradient in the pending sum: give them (zero)
        views now, so that a ``zero_grad`` before the flush is seen ([Note: the gradient state of a parameter])."""
        self.pending_names |= self.reached
        grad = None if self._grad_ref is None else self._grad_ref()
        if grad is None:
            self.attach_grads(self.gradient_buffer(create=True))
            return
        # the live buffer: only the newly reached pieces change (an eager backward reaches one parameter per
        # call; gradient_buffer's scan of the whole bucket each time would cost its parameters squared)
        in_flight.settle_tensor(grad)
        self._view_reached(grad, zero_new=True)

    def mark_pending_views(self) -> None:
        """Take the gradient buffer's present contents as what the pending sum's views hold; called after
        writes of fsdp_pass's own (attaching, an eager hook's zero piece that autograd adds into a view)."""
        grad = None if self._grad_ref is None else self._grad_ref()
        if self._pending is not None and grad is not None:
            self._pending_views_version = grad._version

    @torch.no_grad()
    def _settle_pending_views(self, look_for_cleared: bool = True) -> None:
        """Before the pending sum grows or is reduced: drop the pending pieces of parameters whose ``.grad``
        was cleared since (with ``look_for_cleared``: a scan of the pending names), and refuse a write into
        the views the pending sum cannot follow."""
        grad = None if self._grad_ref is None else self._grad_ref()
        if grad is not None and self._pending_views_version is not None and grad._version != self._pending_views_version:
            written = sorted(n for n in self.pending_names if _is_view_of(self.params[n].grad, grad))
            if written:
                raise RuntimeError(
                    f"the .grad of parameter {written[0]!r} (shape {tuple(self.shapes[written[0]])}) was written in place "
                    f"(zero_grad(set_to_none=False), a clip or a scale) while its gradient was accumulating without "
                    f"sync (fsdp_pass.no_sync / set_requires_gradient_sync(False)); the unreduced sum cannot follow "
                    f"such a write: call zero_grad() with set_to_none=True, or write the gradients after the backward "
                    f"that syncs")
        if not look_for_cleared:
            return
        pending = self._pending.grad
        for name in [n for n in self.pending_names if not _is_view_of(self.params[n].grad, grad)]:
            lo, hi = self.layout.global_range(name)
            pending[lo:hi].zero_()
            self.pending_names.discard(name)

    @torch.no_grad()
    def flush_pending(self, agreed: Collection[str] | None = None) -> None:
        """Reduce-scatter the accumulated gradient once, add it into the gradient shard, free it.
        ``agreed``: every rank flushes the bucket now, as the ranks agreed, and these are the parameters reached
        on some rank; a rank holding no sum then reduces zeros ([Note: an eager bucket's gradient is reduced once
        every rank has it]), and nothing more is agreed."""
        if not self.gradient_sync:
            return
        pending, config = self._pending, self._pending_config
        if pending is not None and pending.grad is not None:
            self._settle_pending_views()
            self.reached |= self.pending_names
            self.forget_pending()
            grad = pending.grad
            pending.grad = None
            del pending
        elif agreed is not None:  # another rank's sum: this rank's part of the reduce-scatter adds nothing
            config = config or self.config(self.param_dtype, self.reduce_dtype)
            grad = torch.zeros(self.shard.numel() * config.shard_world, dtype=config.reduce_dtype,
                               device=self.shard.device)
        else:
            return
        self.add_reduced(lambda: reduce_gradient(grad, config, self.dtype), agreed)

    def forget_pending(self) -> None:
        """Hold no accumulated sum any more (:meth:`flush_pending` has taken it, or it is dropped unreduced)."""
        self._pending = self._pending_config = self._pending_views_version = None
        self._pending_in_graph = False
        self.pending_names = set()

    def add_reduced(self, reduce: Callable[[], torch.Tensor], agreed: Collection[str] | None = None) -> None:
        """Add the gradient shard ``reduce()`` returns into the bucket's gradient (it becomes the gradient if
        none) and attach it, as :meth:`attach_reduced` does."""
        def added() -> torch.Tensor:
            reduced = reduce()
            shard_grad = self.gradient_buffer()
            return reduced if shard_grad is None else shard_grad.add_(reduced)

        self.attach_reduced(added, agreed)

    def attach_reduced(self, reduce: Callable[[], torch.Tensor], agreed: Collection[str] | None = None) -> None:
        """Attach the gradient shard ``reduce()`` returns, the reduction over every data-parallel rank of what
        was reached: first :attr:`reached` is agreed over those ranks (before ``reduce`` issues its
        collective), then the parameters reached on any rank get views ([Note: the gradient state of a
        parameter]). Inside a backward, the caller also calls :func:`queue_flush_all`. ``agreed``: the
        parameters reached on some rank, agreed already (nothing more to agree)."""
        if agreed is not None:
            self.reached.update(agreed)
        else:
            self.agree_reached()
        self.attach_grads(reduce())

    @property
    def grad_divisor(self) -> float:
        """What the summed gradient is divided by: the user's divide factor, else the data-parallel degree
        (either way, times the ranks holding copies of one gradient: ``ShardingMesh.copies``)."""
        if self.gradient_divide_factor is None:
            return self.mesh.divisor
        return self.gradient_divide_factor * self.mesh.copies

    # -- settings -------------------------------------------------------------------------------
    def apply_settings(self, *, gradient_sync: bool | None = None, gradient_divide_factor: float | None = None,
                       param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                       compute_dtype: torch.dtype | None = None, reshard_after_forward: bool | int | None = None) -> None:
        """Set the settings named; None leaves one as it is.

        ``gradient_sync`` and ``gradient_divide_factor``: see buckets/gradient_sync.py. ``param_dtype`` and
        ``reduce_dtype``: fully_shard's ``mp_policy`` (``param_dtype`` is then what eager calls gather in too).
        ``compute_dtype``: what eager calls gather in (a compiled graph sets its own ``param_dtype``).
        ``reshard_after_forward``: fully_shard's (see :attr:`reshard_after_forward`).
        """
        if gradient_sync is not None:
            self.gradient_sync = gradient_sync
        if gradient_divide_factor is not None:
            self.gradient_divide_factor = gradient_divide_factor
        if param_dtype is not None:
            self.param_dtype = self.compute_dtype = param_dtype
        if reduce_dtype is not None:
            self.reduce_dtype = reduce_dtype
        if compute_dtype is not None:
            self.compute_dtype = compute_dtype
        if reshard_after_forward is not None:
            self.reshard_after_forward = reshard_after_forward

    # -- eager collectives ----------------------------------------------------------------------
    def all_gather(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The global buffer (``m*S`` elements), gathered eagerly; parameters are its views."""
        in_flight.settle_before_collective(self.shard.device)
        return gather_bucket(self.shard.detach(), **self.config(dtype or self.dtype, self.dtype)._asdict())

    def config(self, param_dtype: torch.dtype, reduce_dtype: torch.dtype, fp8: bool = False,
               quantized_reduce: QuantizedReduce | None = None) -> GatherConfig:
        """The static arguments of :func:`gather_bucket` for this bucket (``fp8``: the compiled
        gathers of an FP8 bucket, [Note: FP8 all-gather]; eager gathers stay exact;
        ``quantized_reduce``: the compiled reduce-scatter, where there is one, [Note: block-quantized
        gradient reduction])."""
        m = self.mesh
        shard_group = m.group_name(m.shard_dim) if m.shard_size > 1 else None
        rep = m.replicate_dim
        rep_group = m.group_name(rep) if rep is not None and m.replicate_size > 1 else None
        return GatherConfig(param_dtype, reduce_dtype, m.shard_size, shard_group, m.replicate_size, rep_group,
                            self.grad_divisor, self.fp8_gather() if fp8 and self.fp8_tile else None,
                            quantized_reduce if m.shard_size > 1 and self.shard.requires_grad else None,
                            m.node_levels())

    def fp8_gather(self) -> Fp8Gather:
        """Every rank's pieces of this FP8 bucket ([Note: FP8 all-gather]): whole panels of ``fp8_tile`` rows."""
        tile, world = self.fp8_tile, self.mesh.shard_size
        pieces, slots = [], [0] * world
        for name in self.names:
            shape = self.shapes[name]
            cols = shape[-1]
            for rank in range(world):
                lo, hi = self.layout.local_range(name, rank)
                if hi <= lo:
                    continue
                panels = (hi - lo) // (tile * cols)
                offset = self.layout.shard_range(name, rank)[0]
                pieces.append((rank, offset, panels, cols, slots[rank]))
                slots[rank] += panels * -(-cols // tile)
        return Fp8Gather(tile, self.rank, max(slots), tuple(pieces))

    def __repr__(self) -> str:
        return f"DBuffer({self.index}: {len(self.names)} params, {self.layout.summary()}, dtype={self.dtype})"


class _NoteReached(torch.autograd.Function):
    """Identity whose backward notes the names a compiled graph read, when a gradient arrives, and leaves
    out the pieces of parameters frozen at the forward or at the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ref: weakref.ref, names: tuple[str, ...], whole: bool) -> torch.Tensor:
        ctx.ref, ctx.names, ctx.whole = ref, names, whole
        ctx.frozen = ref().frozen(names)
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        buf = ctx.ref()
        if grad is not None and buf is not None:
            frozen = ctx.frozen | buf.frozen(ctx.names)
            buf.note_reached(name for name in ctx.names if name not in frozen)
            if frozen:
                grad = buf.without(grad, frozen, whole=ctx.whole)
        return grad, None, None, None


def note_reached(x: torch.Tensor, buf: DBuffer, names: tuple[str, ...], whole: bool = False) -> torch.Tensor:
    """``x``, an input of a compiled graph that takes ``buf``'s gradient (its shard, or with ``whole`` its
    pending or deferred leaf), through an identity whose backward tells ``buf`` that a backward reached the
    parameters ``names`` the graph reads there, those trainable both when the graph ran forward and when it
    runs backward: the only ones one process's autograd adds into. The others' pieces of the graph's gradient
    (a graph over a trainable bucket computes every piece) are zeroed there, before the gradient reaches the
    live buffer or a pending or deferred sum ([Note: the gradient state of a parameter])."""
    if not x.requires_grad or not torch.is_grad_enabled():
        return x
    return _NoteReached.apply(x, weakref.ref(buf), names, whole)


def _is_view_of(grad: torch.Tensor | None, buffer: torch.Tensor) -> bool:
    """Whether ``grad`` (a parameter's ``.grad``) is a RaggedShard view into ``buffer``."""
    if grad is None:
        return False
    piece = ragged_part(grad)
    return isinstance(piece, RaggedShardTensor) and piece.piece._base is buffer


def pending_leaf(buf: DBuffer, config: GatherConfig) -> torch.Tensor:
    """A fresh leaf of the gathered size (m·S) in ``reduce_dtype`` for accumulating ``buf``'s gradient:
    one element seen m·S times (stride 0), so only its ``.grad`` takes memory."""
    size = buf.shard.numel() * config.shard_world
    leaf = torch.zeros(1, dtype=config.reduce_dtype, device=buf.shard.device).expand(size)
    return leaf.detach().requires_grad_(True)


# [Note: gradient accumulation without sync]: the buckets holding a pending sum, in the order their sums started
# (the same on every rank), process-wide like the backward that flushes them. Held strongly until flushed:
# which collectives a flush issues must not depend on when each rank's garbage collector frees a model.
_with_pending: list[DBuffer] = []


def _end_eager_backward(buf: DBuffer) -> None:
    buf._eager_awaited = None


# [Note: an eager bucket's gradient is reduced once every rank has it]
# An eager backward reduce-scatters a bucket's gradient sum before the backward ends once every trainable
# parameter's gradient is in, so that it holds about one unsharded bucket gradient at a time, as FSDP2's does.
# Whether a bucket is complete, or has any gradient at all, is a rank's own fact: an MoE rank whose tokens reach
# every expert completes the experts' bucket, a rank whose tokens skip one does not until the backward ends, and a
# rank whose tokens skip them all has no sum to reduce. A rank that reduced on its own facts would pair that
# reduce-scatter with another rank's next collective (a hang on NCCL, a wrong sum or a crash on gloo). So every
# reduction of an eager sum happens where the ranks agree, at points every rank reaches in the same order:
#
# * the candidates are the trainable buckets a forward gathered eagerly with grad enabled since the last
#   backward's end (gathers are collectives, so the list is the same on every rank, in the same order), and
#   those still holding a sum on some rank (accumulating under ``no_sync``). A candidate freed meanwhile keeps
#   its place, holding nothing: when each rank's garbage collector frees a model must not change what it sends;
# * early: just before each all-gather an eager backward issues (collectives, matched across ranks like every
#   eager call), one all-reduce of two bytes per candidate on the gathering bucket's data-parallel groups says
#   which are complete on every rank, and those are reduced, in the candidates' order (and left out of the
#   early agreements until the backward ends, though not out of its end's). The second byte says
#   whether every rank reached every parameter of the bucket (no frozen one, no expert left out of an earlier
#   micro-batch): then the flush's own agreement on what was reached (:meth:`DBuffer.agree_reached`, one more
#   all-reduce) has nothing to agree. A unit's gather before its backward ([Note: eager module units] in
#   eager/units.py) carries the flags itself, where the bucket's ranks are one group: each rank sends them after
#   its shard (:func:`gather_in_backward`), so the agreement costs no collective;
# * at the end of a backward (queued by its eager calls, :func:`note_eager_backward`: a unit's backward, an eager
#   gradient, a backward's gather; every rank's backward that reaches the model makes them), one all-reduce per
#   data-parallel group set says, per candidate, whether any rank holds a sum to reduce now, whether any rank
#   holds one at all, whether any rank freed the bucket, and which parameters any rank reached (the flush's
#   :meth:`DBuffer.agree_reached`, for all candidates at once). Every rank then reduces each bucket some rank
#   holds a sum for, a rank that holds none with zeros, and the parameters any rank reached get their ``.grad``
#   views, as one process on the global batch gives them; only candidates still holding a sum somewhere stay
#   listed. A bucket some rank freed (its model deleted while another rank still holds its ``no_sync`` sum,
#   which keeps it alive there) cannot be reduced: every rank drops its sum instead.
#   :func:`fsdp_pass.reduce_gradients` agrees the same way over a model's buckets.
class _Candidate(NamedTuple):
    bucket: weakref.ref  # a trainable DBuffer gathered eagerly outside a backward
    groups: tuple  # its data-parallel process groups
    key: tuple[str, ...]  # their names: the candidates agreed in one all-reduce
    size: int  # its parameters: the bytes it takes in the end-of-backward agreement after its three flags
    device: torch.device  # its shard's: the agreement's tensors live there (NCCL's on the GPU)


def _group_key(groups: Iterable) -> tuple[str, ...]:
    return tuple(g.group_name for g in groups)


def _candidate(buf: DBuffer) -> _Candidate:
    groups = tuple(buf.mesh.data_parallel_groups())
    return _Candidate(weakref.ref(buf), groups, _group_key(groups), len(buf.names), buf.shard.device)


_candidates: list[_Candidate] = []  # in the order they were first gathered
_early: list[_Candidate] = []  # those the running backward has not reduced early (the same list on every rank)
_end_queued_in = -1  # the backward (graph task id) whose end runs _end_of_backward


def before_eager_gather(buf: DBuffer) -> None:
    """Called by :func:`whole_views` before an eager all-gather of ``buf`` ([Note: an eager bucket's gradient is
    reduced once every rank has it])."""
    backward = torch._C._current_graph_task_id()
    if backward != -1:
        _reduce_complete_everywhere(buf, backward)
    elif torch.is_grad_enabled() and buf.shard.requires_grad and not buf.eager_candidate:
        buf.eager_candidate = True
        _candidates.append(_candidate(buf))
        _early.append(_candidates[-1])


class _Agreement(NamedTuple):
    """What the ranks agree on before a backward's eager gather: per candidate, two flags (max over the ranks)."""

    candidates: list[_Candidate]
    buckets: list[DBuffer | None]  # the candidates' buckets (None: freed)
    flags: torch.Tensor  # uint8 (candidates, 2): not complete here; not every parameter reached here


def _agreement(gathering: DBuffer, backward: int) -> _Agreement | None:
    """This rank's side of the agreement before ``gathering``'s gather in ``backward`` (None: no candidates)."""
    note_eager_backward()
    key = _group_key(gathering.mesh.data_parallel_groups())
    candidates = [c for c in _early if c.key == key]
    if not candidates:
        return None
    buckets = [c.bucket() for c in candidates]
    flags = torch.tensor([[b is None or not b._eager_complete, b is None or not b._reached_all]
                          for b in buckets], dtype=torch.uint8, device=gathering.shard.device)
    return _Agreement(candidates, buckets, flags)


def _reduce_agreed(agreement: _Agreement, flags: torch.Tensor) -> None:
    """Reduce the candidates complete on every rank (``flags``: the agreement's flags, max over the ranks)."""
    for candidate, b, (incomplete, partly_reached) in zip(agreement.candidates, agreement.buckets, flags.tolist()):
        if not incomplete:
            _early.remove(candidate)
            _flush(b, b.names if not partly_reached else None)


def _reduce_agreed_by_all_reduce(agreement: _Agreement, gathering: DBuffer) -> None:
    """Agree in all-reduces of the flags over ``gathering``'s data-parallel groups, then reduce."""
    flags = agreement.flags
    for group in gathering.mesh.data_parallel_groups():
        flags = collectives.all_reduced(flags, group, "max")
    _reduce_agreed(agreement, flags)


def _reduce_complete_everywhere(gathering: DBuffer, backward: int) -> None:
    agreement = _agreement(gathering, backward)
    if agreement is not None:
        _reduce_agreed_by_all_reduce(agreement, gathering)


@torch.no_grad()
def _agree_and_flush(candidates: list[_Candidate]) -> list[_Candidate]:
    """Reduce every one of ``candidates`` (the same list on every rank) that some rank holds a sum for, on every
    rank, after one all-reduce per data-parallel group set ([Note: an eager bucket's gradient is reduced once
    every rank has it]); the candidates that still hold a sum on some rank (accumulating without sync)."""
    by_groups: dict[tuple[str, ...], list[_Candidate]] = {}
    for c in candidates:
        by_groups.setdefault(c.key, []).append(c)
    kept = []
    for group_candidates in by_groups.values():
        buckets = [c.bucket() for c in group_candidates]
        # per candidate: a sum to reduce now here, a sum here, the bucket freed here, each parameter reached here
        sent: list[int] = []
        for c, b in zip(group_candidates, buckets):
            if b is None:
                sent += [0, 0, 1] + [0] * c.size
            else:
                holds = b._pending is not None and b._pending.grad is not None
                if holds and b.gradient_sync:
                    b._settle_pending_views()  # a .grad cleared since it was summed leaves the sum: not reached
                reached = b.reached | b.pending_names
                sent += [holds and b.gradient_sync, holds, 0, *(name in reached for name in b.names)]
        flags = torch.tensor(sent, dtype=torch.uint8, device=group_candidates[0].device)
        for group in group_candidates[0].groups:
            flags = collectives.all_reduced(flags, group, "max")
        agreed, at = flags.tolist(), 0
        for c, b in zip(group_candidates, buckets):
            reduce_anywhere, held_anywhere, freed_anywhere = agreed[at:at + 3]
            reached = agreed[at + 3:at + 3 + c.size]
            at += 3 + c.size
            if freed_anywhere:  # its model is gone (a rank that freed it cannot reduce): its sums go with it
                if b is not None:
                    _drop_pending(b)
            elif reduce_anywhere:
                _flush(b, [name for name, hit in zip(b.names, reached) if hit])
            elif held_anywhere:
                kept.append(c)
    return kept


def _drop_pending(buf: DBuffer) -> None:
    """Forget ``buf``'s sum, unreduced."""
    buf.forget_pending()
    if buf in _with_pending:
        _with_pending.remove(buf)


def flush_agreed(buffers: list[DBuffer]) -> None:
    """Reduce, on every rank, each of ``buffers`` (the same on every rank) that some rank holds an accumulated sum
    for ([Note: an eager bucket's gradient is reduced once every rank has it])."""
    _agree_and_flush([_candidate(buf) for buf in buffers])


def note_eager_backward() -> None:
    """The running backward made an eager call: its end agrees on the candidates' sums ([Note: an eager bucket's
    gradient is reduced once every rank has it]). Outside a backward, nothing."""
    backward = torch._C._current_graph_task_id()
    if backward != -1:
        _queue_end_of_backward(backward)


@torch.no_grad()
def gather_in_backward(buf: DBuffer, into: torch.Tensor) -> None:
    """An eager backward's all-gather of ``buf`` (in ``compute_dtype``) into ``into`` (``m·S`` elements), with the
    agreement before it ([Note: an eager bucket's gradient is reduced once every rank has it]) carried by the same
    collective where the bucket's ranks are one group: each rank sends its flags after its shard."""
    agreement = _agreement(buf, torch._C._current_graph_task_id())
    config = buf.config(buf.compute_dtype, buf.dtype)
    if agreement is None or config.levels is not None or config.replicate_group is not None or config.shard_world < 2:
        if agreement is not None:
            _reduce_agreed_by_all_reduce(agreement, buf)
        into.copy_(buf.all_gather(buf.compute_dtype))
        return
    in_flight.settle_before_collective(buf.shard.device)
    size, world = buf.shard.numel(), config.shard_world
    sent = torch.cat([buf.shard.detach().to(buf.compute_dtype), agreement.flags.reshape(-1).to(buf.compute_dtype)])
    received = _c10d.wait_tensor(_c10d.all_gather_into_tensor(sent, world, config.shard_group)).view(world, -1)
    into.view(world, size).copy_(received[:, :size])
    _reduce_agreed(agreement, received[:, size:].amax(0).to(torch.uint8).view(-1, 2))


def _before_pending_accumulates(ref: weakref.ref) -> None:
    """Tensor hook of a pending leaf: settle the views before autograd adds into the sum."""
    buf = ref()
    if buf is not None and buf._pending is not None and buf._pending.grad is not None:
        buf._settle_pending_views()


def _pending_accumulated(ref: weakref.ref) -> None:
    """A pending sum grew: its parameters get views; if the bucket syncs, every pending sum flushes at the end
    of this backward."""
    buf = ref()
    if buf is None:
        return
    buf._hold_pending_views()
    if buf.gradient_sync:
        queue_flush_all()


def queue_flush_all() -> None:
    """Flush every pending sum whose bucket syncs at the end of the running backward (once per backward): a
    synced backward that does not reach a bucket still reduces what its micro-batches accumulated."""
    _queue_end_of_backward(torch._C._current_graph_task_id())


def _queue_end_of_backward(backward: int) -> None:
    global _end_queued_in
    if _end_queued_in != backward:  # once per backward (one that raised never ran its callback)
        _end_queued_in = backward
        torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)


def _end_of_backward() -> None:
    """Reduce the candidates' sums as the ranks agree, then every other pending sum whose bucket syncs (compiled
    graphs', which every rank holds alike)."""
    if _candidates:
        kept = _agree_and_flush(_candidates)
        still = {id(c) for c in kept}
        for c in _candidates:
            b = c.bucket()
            if b is not None and id(c) not in still:
                b.eager_candidate = False
        _candidates[:] = _early[:] = kept
    for buf in list(_with_pending):
        _flush(buf)


def _flush(buf: DBuffer, agreed: Collection[str] | None = None) -> None:
    """Reduce ``buf``'s pending sum if its bucket syncs (``agreed``: see :meth:`DBuffer.flush_pending`), and
    forget the bucket once it holds none."""
    buf.flush_pending(agreed)
    if buf._pending is None and buf in _with_pending:
        _with_pending.remove(buf)


def at_end_of_backward(ref: weakref.ref, run: Callable[[DBuffer], None]) -> None:
    """Queue ``run(bucket)`` for the end of the running backward (nothing if the bucket is gone by then)."""
    def call() -> None:
        buf = ref()
        if buf is not None:
            run(buf)

    torch.autograd.Variable._execution_engine.queue_callback(call)
