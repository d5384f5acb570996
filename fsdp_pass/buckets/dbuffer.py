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

[Note: gradients of parameters a step does not use]
One process leaves ``.grad`` None on a parameter no forward of the step used, and optimizers skip it
(no weight decay, no moment decay, no step count). A bucket's reduced gradient covers all of its
parameters, so attaching every view would hand such a parameter a zero gradient, and AdamW would
decay it. So a bucket attaches views only for the parameters a gradient reaches (:attr:`DBuffer.used`):
a compiled forward notes the parameters it reads (compile/backend.py), an eager gradient its own
(eager/calls.py). A step starts when the bucket holds no gradient any more (``zero_grad``, or the
first step): the first note then forgets the last step's set. With ``zero_grad(set_to_none=False)``
the views stay, as a used parameter's zero gradient does in one process. With nothing noted (a
gradient from a path that notes nothing) every view is attached, as before.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..placement import RaggedShard
from ..options import QuantizedReduce
from ..planner import Layout
from ..tensor import flat_buffers, in_flight
from ..tensor.ragged_tensor import BUCKET_ATTR, RaggedShardTensor, bucket_of, is_sharded, over_pieces, ragged_part
from .gather import Fp8Gather, GatherConfig, gather_bucket, reduce_gradient
from .mesh import ShardingMesh
from .whole_values import whole_views

__all__ = ["DBuffer", "at_end_of_backward", "buffers_of", "is_unsharded", "mark_unsharded", "pending_leaf"]

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
        if mesh.shard_size > 1:  # its process groups are made now, while the mesh's ranks make their buckets alike
            mesh.bucket_group_name()
        self.params: dict[str, nn.Parameter] = {}
        self._placements: dict[str, RaggedShard] = {}
        self._segment_index: dict[str, int] | None = None  # parameter name → segment position (segment_index)
        self._grad_ref: weakref.ref | None = None  # the gradient shard the parameters' .grad views live in
        # [Note: gradient accumulation without sync]
        self.gradient_sync = True  # False inside fsdp_pass.no_sync(model)
        self._pending: torch.Tensor | None = None  # leaf whose .grad sums the unsharded gradients
        self._pending_config: GatherConfig | None = None
        self._flush_queued = False
        # [Note: the last reduce-scatter overlaps the optimizer step] in step/deferred_reduce.py
        # (kept here, driven by step/deferred_reduce.py)
        self.deferred: torch.Tensor | None = None  # leaf whose .grad is this step's unreduced gradient (m·S)
        self.deferred_config: GatherConfig | None = None
        self.deferred_queued = False  # its reduce is queued for the end of this backward
        # Reduced gradients are divided by this (None: the data-parallel degree, a mean); see
        # fsdp_pass.set_gradient_divide_factor. Compiled graphs hold it as a constant.
        self.gradient_divide_factor: float | None = None
        # trainable parameters a gradient reaches in this step: only they get .grad views ([Note: gradients
        # of parameters a step does not use])
        self.used: set[str] = set()
        self._used_attached = False  # a gradient was attached for `used` (the next step may start)
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
        if torch.is_grad_enabled():  # [Note: gradients of parameters a step does not use]
            self.note_used((name,))
        return whole_views(self)[name]

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
            cleared = [name for name, p in self.params.items() if p.requires_grad and not _is_view_of(p.grad, grad)]
            if len(cleared) == len(self.trainable_names):
                grad = None
            else:
                with torch.no_grad():
                    for name in cleared:
                        self.local_piece(name, grad).zero_()
        if grad is None and create:
            grad = torch.zeros_like(self.shard, requires_grad=False)
        return grad

    def attach_grads(self, grad: torch.Tensor) -> None:
        """Point the ``.grad`` of every trainable parameter used in this step (all, when none was noted) at
        its view of the gradient shard ``grad`` ([Note: gradients of parameters a step does not use])."""
        self._grad_ref = weakref.ref(grad)
        self._used_attached = True
        flat_buffers.register(grad, self.slots)  # [Note: one kernel per bucket]
        for name, p in self.params.items():
            if p.requires_grad and (not self.used or name in self.used) and not _is_view_of(p.grad, grad):
                p.grad = self.wrap(name, self.local_piece(name, grad))

    def note_used(self, names: Iterable[str]) -> None:
        """Parameters ``names`` take part in this step's gradient. The first note after the set was attached
        starts a new step if the bucket holds no gradient any more ([Note: gradients of parameters a step does
        not use])."""
        if self._used_attached and not self._holds_gradient():
            self.used.clear()
        self._used_attached = False
        self.used.update(names)

    def _holds_gradient(self) -> bool:
        """Whether a gradient of this step is held: attached views, an accumulated or a deferred gradient."""
        if self._pending is not None and self._pending.grad is not None:
            return True
        if self.deferred is not None and self.deferred.grad is not None:
            return True
        grad = None if self._grad_ref is None else self._grad_ref()
        return grad is not None and any(_is_view_of(self.params[n].grad, grad) for n in self.used if n in self.params)

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
        """The autograd leaf whose ``.grad`` accumulates the unsharded gradient (made on first use)."""
        if self._pending is None:
            self._pending = self.gradient_leaf(config, _queue_flush)
            self._pending_config = config
        return self._pending

    @torch.no_grad()
    def add_pending(self, name: str, whole: torch.Tensor) -> None:
        """Add an eager call's whole gradient of ``name`` (flat, summed over nothing yet) into the accumulated
        bucket gradient, which the backward that syncs reduce-scatters once ([Note: gradient accumulation
        without sync]; eager calls: [Note: eager calls on sharded parameters] in eager/calls.py)."""
        leaf = self.pending_input(self._pending_config or self.config(self.param_dtype, self.reduce_dtype))
        if leaf.grad is None:
            leaf.grad = torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        lo, hi = self.layout.global_range(name)
        leaf.grad[lo:hi].add_(whole.to(leaf.dtype))
        _queue_flush(weakref.ref(self))

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
    def flush_pending(self) -> None:
        """Reduce-scatter the accumulated gradient once, add it into the gradient shard, free it."""
        self._flush_queued = False
        pending, config = self._pending, self._pending_config
        if pending is None or pending.grad is None or not self.gradient_sync:
            return
        self._pending = self._pending_config = None
        grad = pending.grad
        pending.grad = None
        del pending
        self.add_reduced(reduce_gradient(grad, config, self.dtype))

    def add_reduced(self, reduced: torch.Tensor) -> None:
        """Add a reduced gradient shard into the bucket's gradient (it becomes the gradient if none) and attach it."""
        shard_grad = self.gradient_buffer()
        if shard_grad is None:
            shard_grad = reduced
        else:
            shard_grad.add_(reduced)
        self.attach_grads(shard_grad)

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
        shard_group = m.bucket_group_name() if m.shard_size > 1 else None
        rep = m.replicate_dim
        rep_group = m.group_name(rep) if rep is not None and m.replicate_size > 1 else None
        return GatherConfig(param_dtype, reduce_dtype, m.shard_size, shard_group, m.replicate_size, rep_group,
                            self.grad_divisor, self.fp8_gather() if fp8 and self.fp8_tile else None,
                            quantized_reduce if m.shard_size > 1 and self.shard.requires_grad else None)

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


def _queue_flush(ref: weakref.ref) -> None:
    """Post-accumulate-grad hook of a pending leaf: flush at the end of this backward, once."""
    buf = ref()
    if buf is None or not buf.gradient_sync or buf._flush_queued:
        return
    buf._flush_queued = True
    at_end_of_backward(ref, DBuffer.flush_pending)


def at_end_of_backward(ref: weakref.ref, run: Callable[[DBuffer], None]) -> None:
    """Queue ``run(bucket)`` for the end of the running backward (nothing if the bucket is gone by then)."""
    def call() -> None:
        buf = ref()
        if buf is not None:
            run(buf)

    torch.autograd.Variable._execution_engine.queue_callback(call)
