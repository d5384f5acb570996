"""Sharded parameters used outside a compiled graph: whole values on demand, gradients into the shards.

[Note: eager calls on sharded parameters]
A compiled graph gathers each bucket once and reduce-scatters its gradient (passes/rewrite.py). Code
that runs eagerly on a sharded module (Hugging Face ``generate``, an eval loop without
``torch.compile``, a submodule called from a callback, the eager embedding and head of a model whose
blocks are compiled one by one) reaches ``RaggedShardTensor.__torch_dispatch__`` with parameters
whose pieces cannot answer a matmul or a broadcast. For those ops:

* forward: dispatch runs the op on the parameters' whole values. :func:`whole_parameter` all-gathers
  the parameter's bucket (in the compiled graphs' ``mp_policy`` param_dtype, so an eager head on a
  compiled body's output computes in the same dtype) and keeps the last gathered bucket, keyed by
  the shard's version counter (an optimizer step or any in-place write to a piece makes the copy stale). So the parameters of
  a module unit cost one all-gather, and an eager forward holds the shards plus one gathered bucket
  (two while the next is gathered), like FSDP2's reshard after forward. The gather is below autograd: autograd
  records the op with the sharded parameter as its input and saves that (a piece), not the
  gathered copy, and backward gathers again where its formulas need the weight.
* backward: autograd produces a whole-tensor gradient for the parameter. A hook on the parameter
  (:func:`reduce_eager_gradient`, registered when it is sharded) all-reduces it over the bucket's
  ranks, divides by the data-parallel degree (or the bucket's gradient divide factor), and adds
  this rank's piece into the bucket's gradient shard: the same ``.grad`` views the compiled path fills, so an eager training step is
  correct too (one all-reduce per parameter: slower than the compiled path, which reduce-scatters
  once per bucket).

A tensor/expert-parallel DTensor parameter takes the same path one level down: DTensor dispatch (or
torchtitan's ``local_map``) hands the op its local tensor, a RaggedShard piece that carries the
bucket too, whose whole value is the parameter's local block; the hook on the parameter gets a
DTensor gradient, takes its block in the parameter's placements, and returns the piece as a DTensor.

Eager calls are collective, like every FSDP forward: every rank of the bucket's mesh must make them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from . import collectives
from .dbuffer import DBuffer, bucket_of, is_sharded
from .ragged_tensor import RaggedShardTensor
from .uninitialized import check_gathered
from .wrapper_check import check_mesh_is_current

__all__ = ["drop_gathered", "is_eager_gatherable", "reduce_eager_gradient", "whole_parameter"]

_KEPT_BUCKETS = 1  # gathered buckets kept for the next ops: a module's parameters share one gather

# id(DBuffer) → (weak ref to it, the shard's version when gathered, parameter name → whole view)
_gathered: OrderedDict[int, tuple[weakref.ref, int, dict[str, torch.Tensor]]] = OrderedDict()


def is_eager_gatherable(t: torch.Tensor) -> bool:
    """Whether dispatch may replace ``t`` by its whole value: a sharded parameter, or the local piece
    of a sharded TP/EP DTensor parameter (its whole value is the parameter's local block)."""
    return isinstance(t, RaggedShardTensor) and is_sharded(t)


def whole_parameter(p: RaggedShardTensor) -> torch.Tensor:
    """The whole value of sharded parameter ``p``: a view of its bucket, gathered at most once per version."""
    buf, name = bucket_of(p)
    key, version = id(buf), buf.shard._version
    entry = _gathered.get(key)
    if entry is not None and entry[0]() is buf and entry[1] == version:
        _gathered.move_to_end(key)
        return entry[2][name]
    check_mesh_is_current(buf)  # before the first gather ([Note: wrappers around a sharded model])
    _gathered.pop(key, None)
    while len(_gathered) >= _KEPT_BUCKETS:  # free before gathering: the peak is the kept buckets plus this one
        _gathered.popitem(last=False)
    views = buf.views(buf.all_gather(buf.compute_dtype))
    check_gathered(buf, views)  # [Note: uninitialized shards]
    _gathered[key] = (weakref.ref(buf), version, views)
    return views[name]


def drop_gathered() -> None:
    """Free the gathered buckets kept for eager calls (they are also dropped as newer ones come)."""
    _gathered.clear()


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
    whole = grad.detach().reshape(-1).to(buf.dtype, copy=True)  # summed in the master dtype
    for group in buf.mesh.data_parallel_groups():
        collectives.all_reduce_(whole, group)
    a, b = buf.layout.local_range(name, buf.rank)
    piece = (whole[a:b] / buf.grad_divisor).to(buf.dtype)
    buf.attach_grads(buf.gradient_buffer(create=True))
    return buf.wrap(name, piece)
