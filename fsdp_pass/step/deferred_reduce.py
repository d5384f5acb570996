"""The last reduce-scatter of a backward, left in flight until its gradient is first read.

[Note: the last reduce-scatter overlaps the optimizer step]
Backward reduces buckets in the reverse of the forward's order, so the bucket a graph gathers first
(a whole model's embedding) is reduced last: its reduce-scatter starts when the graph's compute is
over, and in the graph nothing is left to hide it behind. With ``overlap_last_reduce`` on, a compiled
graph of several buckets hands that bucket's whole gradient out unreduced, to a leaf of its own (the
graph variant of [Note: gradient accumulation without sync], for that bucket only). At the end of the
backward its reduce-scatter is issued without a wait; its output becomes the bucket's gradient shard,
and the parameters' ``.grad`` point at their views of it at once. The wait, and the division by the
data-parallel degree (in place), run where one of those gradients is first read:

* any op on a RaggedShard view of that output (the check at the top of tensor/dispatch.py's ``dispatch``),
  so an optimizer's reads, ``clip_grad_norm_``, a user's ``p.grad.norm()``;
* the RaggedShard methods that hand out or move the piece itself (``to_local``, ``full_tensor``,
  ``redistribute``, pickling, checkpoint shards, ``repr``);
* the bucket's own gradient methods (``DBuffer.gradient_buffer``: zero, scale, the next accumulation);
* the next compiled call (a ``zero_grad(set_to_none=True)`` leaves nobody to read it).

So the optimizer's Python, its ops on parameters and states, and its ops on the other buckets'
gradients run while the transfer is in flight. On CPU, any other collective fsdp_pass issues first
(an optimizer's redistribute, a norm's all-reduce, an eager gather, the next step's prefetched
gathers) waits for it before it starts (``settle_before_collective`` in tensor/in_flight.py, [Note: one collective in
flight on gloo] in compile/passes/schedule.py). A foreach or fused optimizer reads every gradient in
its first kernel; ``step_reduced_first`` ([Note: the reduced gradients are stepped first] in
step/reduced_first.py) steps the other buckets' parameters first, so their whole update runs while it
is in flight. The values are today's exactly:
the same reduce-scatter of the same gradient, then the same IEEE division. It applies only where
the wait is the last thing needed: one shard group (an HSDP all-reduce would be a collective at the
reader, who may be one rank only), reduce dtype = master dtype (the views are of the reduce-scatter's
output), and no gradient held already (it is then reduced and added at once, as without the option).
"""

from __future__ import annotations

import weakref

import torch

from ..buckets.dbuffer import DBuffer, at_end_of_backward, queue_flush_all
from ..buckets.gather import GatherConfig, reduce_gradient
from ..tensor import in_flight

__all__ = ["deferred_input", "reduce_deferred", "start"]

_c10d = torch.ops._c10d_functional


def start(grad: torch.Tensor, config: GatherConfig) -> torch.Tensor:
    """Issue the reduce-scatter of a bucket's whole gradient ``grad``; return its output (the gradient
    shard to attach), whose values are final once ``in_flight.settle_read`` or ``in_flight.settle_all`` saw it."""
    unreduced = grad.to(config.reduce_dtype).contiguous()
    reduced = _c10d.reduce_scatter_tensor(unreduced, "sum", config.shard_world, config.shard_group)
    in_flight.track(reduced, unreduced, config.grad_divisor)
    return reduced


def deferred_input(buf: DBuffer, config: GatherConfig) -> torch.Tensor:
    """The autograd leaf a compiled graph hands ``buf``'s unreduced gradient to, when its reduce-scatter
    is left in flight after backward; made once and kept on the bucket (``buf.deferred``)."""
    if buf.deferred is None:
        buf.deferred = buf.gradient_leaf(config, _queue_reduce)
        buf.deferred_config = config
    return buf.deferred


@torch.no_grad()
def reduce_deferred(buf: DBuffer) -> None:
    """Issue the reduce-scatter of the gradient handed to :func:`deferred_input` and attach its output
    without waiting; reduce at once (as the graph would) where waiting later is not exact or simple."""
    buf.deferred_queued = False
    leaf, config = buf.deferred, buf.deferred_config
    if leaf is None or leaf.grad is None:
        return
    grad = leaf.grad
    leaf.grad = None
    # a block-quantized reduction ([Note: block-quantized gradient reduction]) runs at once: its all-to-all
    # and dequantize-and-sum are not what in_flight.track settles
    if (buf.gradient_buffer() is None and config.shard_world > 1 and config.replicate_world == 1
            and config.reduce_dtype == buf.dtype and config.quantized_reduce is None and config.levels is None):
        buf.attach_reduced(lambda: start(grad, config))
    else:
        buf.add_reduced(lambda: reduce_gradient(grad, config, buf.dtype))
    queue_flush_all()  # what earlier micro-batches accumulated without sync


def _queue_reduce(ref: weakref.ref) -> None:
    """Post-accumulate-grad hook of a deferred-reduce leaf: reduce at the end of this backward, once."""
    buf = ref()
    if buf is None or buf.deferred_queued:
        return
    buf.deferred_queued = True
    at_end_of_backward(ref, reduce_deferred)
