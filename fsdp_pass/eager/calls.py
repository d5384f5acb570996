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
  (:func:`reduce_eager_gradient`, registered when it is sharded) adds it into the bucket's unreduced
  sum, the one accumulation without sync uses ([Note: gradient accumulation without sync]), and
  returns a zero piece for autograd to add into the parameter's ``.grad`` view. A backward that syncs
  reduce-scatters each sum once (the HSDP all-reduce, the division by the data-parallel degree or the
  bucket's gradient divide factor, quantized or in two levels, as the compiled graphs reduce) into the
  gradient shard the compiled path fills, so an eager training step is correct and costs one
  reduce-scatter per bucket: once every trainable parameter of the bucket has its gradient in on every
  rank, agreed before the backward's next eager all-gather (so the backward holds about one unsharded
  bucket gradient at a time, as FSDP2's; [Note: an eager bucket's gradient is reduced once every rank
  has it] in buckets/dbuffer.py), else at the backward's end. Under ``no_sync`` the sum waits for the
  step's last backward.

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

from ..buckets.dbuffer import DBuffer
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
    if grad is None:  # a unit's backward took the whole gradient itself ([Note: eager module units] in eager/units.py)
        return None
    if buf is None or not buf.params[name].requires_grad:  # frozen since its forward: one process adds nothing
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
    # reached ([Note: the gradient state of a parameter] in buckets/dbuffer.py), into the bucket's unreduced sum:
    # reduce-scattered once per bucket, in this backward if the bucket syncs, else at the step's last backward
    # ([Note: gradient accumulation without sync])
    buf.add_pending({name: grad.detach().reshape(-1)})
    return buf.wrap(name, torch.zeros_like(buf.local_piece(name)))


def eager_gradient_added(ref: weakref.ref, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a sharded parameter: under ``no_sync`` autograd has just added the zero
    piece :func:`reduce_eager_gradient` returned into the parameter's view, a write of fsdp_pass's own
    ([Note: the gradient state of a parameter] in buckets/dbuffer.py)."""
    buf = ref()
    if buf is not None:
        buf.mark_pending_views()


@torch.no_grad()
def reduce_gradient_of_swapped_out(ref: weakref.ref, name: str, swapped_out: torch.Tensor) -> None:
    """Post-accumulate-grad hook on the contents a parameter had before it was sharded, which a live autograd
    graph still accumulates into ([Note: a parameter used before it was sharded]): the whole gradient joins
    the bucket's unreduced sum as an eager call's does, and the parameter's ``.grad`` is its view."""
    grad, swapped_out.grad = swapped_out.grad, None
    reduce_eager_gradient(ref, name, grad)  # its zero piece is not added anywhere: nothing to add
