"""Sharded parameters used outside a compiled graph: whole values on demand, gradients into the shards.

[Note: eager calls on sharded parameters]
A compiled graph gathers each bucket once and reduce-scatters its gradient (compile/passes/rewrite.py). Code
that runs eagerly on a sharded module (Hugging Face ``generate``, an eval loop without
``torch.compile``, a submodule called from a callback, the eager embedding and head of a model whose
blocks are compiled one by one) reaches ``RaggedShardTensor.__torch_dispatch__`` with parameters
whose pieces cannot answer a matmul or a broadcast. For those ops:

* forward: dispatch (tensor/dispatch.py) runs the op on the parameters' whole values. The bucket
  (``DBuffer.whole_parameter``, buckets/whole_values.py) all-gathers itself (in the compiled graphs'
  ``mp_policy`` param_dtype, so an eager head on a compiled body's output computes in the same
  dtype) and keeps the last gathered bucket, keyed by the shard's version counter (an optimizer step
  or any in-place write to a piece makes the copy stale). So the parameters of a module unit cost
  one all-gather, and an eager forward holds the shards plus one gathered bucket (two while the next
  is gathered), like FSDP2's reshard after forward. The gather is below autograd: autograd records
  the op with the sharded parameter as its input and saves that (a piece), not the gathered copy,
  and backward gathers again where its formulas need the weight.
* backward: autograd produces a whole-tensor gradient for the parameter. A hook on the parameter
  (:func:`reduce_eager_gradient`, registered when it is sharded) all-reduces it over the bucket's
  ranks, divides by the data-parallel degree (or the bucket's gradient divide factor), and adds
  this rank's piece into the bucket's gradient shard: the same ``.grad`` views the compiled path fills, so an eager training step is
  correct too (one all-reduce per parameter: slower than the compiled path, which reduce-scatters
  once per bucket). Under ``no_sync`` (or while the bucket holds an accumulated gradient) the whole
  gradient is added into the bucket's pending gradient instead, which the step's last backward
  reduce-scatters once with the compiled graphs' ([Note: gradient accumulation without sync]).

A tensor/expert-parallel DTensor parameter takes the same path one level down: DTensor dispatch (or
torchtitan's ``local_map``) hands the op its local tensor, a RaggedShard piece that carries the
bucket too, whose whole value is the parameter's local block; the hook on the parameter gets a
DTensor gradient, takes its block in the parameter's placements, and returns the piece as a DTensor.

Eager calls are collective, like every FSDP forward: every rank of the bucket's mesh must make them.

[Note: a parameter used before it was sharded]
The backend shards a compiled model's parameters at its first call ([Note: parameters no graph reads]
in compile/passes/unread.py), but code Dynamo leaves to eager can run before that call: a model whose
frame Dynamo skips (a graph break inside its loop over blocks) calls its embedding eagerly before the
first block's frame is compiled. That forward's autograd graph holds the parameter's old contents
(its gradient accumulator does), and the swap into a RaggedShard parameter leaves them behind, so the
first backward would accumulate the whole gradient into a tensor nobody reads. The swap keeps those
contents alive with a hook (:func:`reduce_gradient_of_swapped_out`) that takes the gradient as it
arrives and reduces it into the bucket like an eager call's, so the first step is one process's too.
"""

from __future__ import annotations

import weakref

import torch

from ..tensor import collectives
from ..buckets.dbuffer import DBuffer, queue_flush_all
from ..tensor.ragged_tensor import RaggedShardTensor

__all__ = ["eager_gradient_added", "reduce_eager_gradient", "reduce_gradient_of_swapped_out"]

@torch.no_grad()
def reduce_eager_gradient(ref: weakref.ref, name: str, grad: torch.Tensor) -> torch.Tensor | None:
    """Tensor hook of a sharded parameter (see [Note: eager calls on sharded parameters]).

    Sums the whole-tensor ``grad`` over the bucket's ranks, divides by the data-parallel degree and
    returns this rank's piece as a RaggedShard gradient, after pointing ``.grad`` at the bucket's
    gradient shard: autograd then adds the returned piece into that view in place.
    """
    buf: DBuffer | None = ref()
    if buf is None:
        return None
    if isinstance(grad, RaggedShardTensor):  # cannot happen from model code: seeds and formulas are whole tensors
        raise RuntimeError(
            f"the eager gradient of parameter {name!r} (shape {tuple(grad.shape)}) arrived as a RaggedShard piece, "
            f"which holds only this rank's part of this rank's gradient; compute the loss with "
            f'torch.compile(model, backend="vescale") instead'
        )
    spec = buf.dtensor_specs.get(name)
    if spec is not None:  # a TP/EP parameter: its gradient's block in the parameter's placements
        grad = grad.redistribute(spec.mesh, spec.placements)._local_tensor
    buf.note_reached([name])  # [Note: the gradient state of a parameter] in buckets/dbuffer.py
    if buf.accumulating:  # no_sync, or a gradient already pending: reduced once, at the step's last backward
        buf.add_pending(name, grad.detach().reshape(-1))
        return buf.wrap(name, torch.zeros_like(buf.local_piece(name)))
    whole = grad.detach().reshape(-1).to(buf.dtype, copy=True)  # summed in the master dtype
    for group in buf.mesh.data_parallel_groups():
        collectives.all_reduce_(whole, group)
    a, b = buf.layout.local_range(name, buf.rank)
    piece = (whole[a:b] / buf.grad_divisor).to(buf.dtype)
    buf.attach_grads(buf.gradient_buffer(create=True))
    queue_flush_all()  # what earlier micro-batches accumulated without sync
    return buf.wrap(name, piece)


def eager_gradient_added(ref: weakref.ref, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a sharded parameter: under ``no_sync`` autograd has just added the zero
    piece :func:`reduce_eager_gradient` returned into the parameter's view, a write of fsdp_pass's own
    ([Note: the gradient state of a parameter] in buckets/dbuffer.py)."""
    buf = ref()
    if buf is not None:
        buf.mark_pending_views()


@torch.no_grad()
def reduce_gradient_of_swapped_out(ref: weakref.ref, name: str, owner: weakref.ref, swapped_out: torch.Tensor) -> None:
    """Post-accumulate-grad hook on the contents parameter ``owner`` had before it was sharded, which a
    live autograd graph still accumulates into ([Note: a parameter used before it was sharded]): the
    whole gradient is reduced into the bucket and added to the parameter's ``.grad``."""
    grad, swapped_out.grad = swapped_out.grad, None
    piece = reduce_eager_gradient(ref, name, grad)
    param = owner()
    if piece is not None and param is not None:
        param.grad.add_(piece)
