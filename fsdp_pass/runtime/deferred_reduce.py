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

* any op on a RaggedShard view of that output (the check at the top of ``ragged_dispatch.dispatch``),
  so an optimizer's reads, ``clip_grad_norm_``, a user's ``p.grad.norm()``;
* the RaggedShard methods that hand out or move the piece itself (``to_local``, ``full_tensor``,
  ``redistribute``, pickling, checkpoint shards, ``repr``);
* the bucket's own gradient methods (``DBuffer.gradient_buffer``: zero, scale, the next accumulation);
* the next compiled call (a ``zero_grad(set_to_none=True)`` leaves nobody to read it).

So the optimizer's Python, its ops on parameters and states, and its ops on the other buckets'
gradients run while the transfer is in flight. On CPU, any other collective fsdp_pass issues first
(an optimizer's redistribute, a norm's all-reduce, an eager gather, the next step's prefetched
gathers) waits for it before it starts (:func:`settle_before_collective`, [Note: one collective in
flight on gloo] in passes/schedule.py). A foreach or fused optimizer reads every gradient in
its first kernel; ``fsdp_pass.step_reduced_first(opt)`` (optimizer_step.py) steps the other buckets'
parameters first, so their whole update runs while it is in flight. The values are today's exactly:
the same reduce-scatter of the same gradient, then the same IEEE division. It applies only where
the wait is the last thing needed: one shard group (an HSDP all-reduce would be a collective at the
reader, who may be one rank only), reduce dtype = master dtype (the views are of the reduce-scatter's
output), and no gradient held already (it is then reduced and added at once, as without the option).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

from .gather import GatherConfig

__all__ = ["any_in_flight", "is_in_flight", "settle_all", "settle_before_collective", "settle_read", "settle_tensor",
           "start"]

_c10d = torch.ops._c10d_functional


class _InFlight(NamedTuple):
    reduced: torch.Tensor  # the reduce-scatter's output (S elements): the gradient shard, before the division
    unreduced: torch.Tensor  # its input (m·S), kept alive until the wait: the transfer reads it
    divisor: float  # GatherConfig.grad_divisor


_in_flight: dict[int, _InFlight] = {}  # the output's storage address → the reduce-scatter writing it


def any_in_flight() -> bool:
    return bool(_in_flight)


def start(grad: torch.Tensor, config: GatherConfig) -> torch.Tensor:
    """Issue the reduce-scatter of a bucket's whole gradient ``grad``; return its output (the gradient
    shard to attach), whose values are final once :func:`settle_read` or :func:`settle_all` saw it."""
    unreduced = grad.to(config.reduce_dtype).contiguous()
    reduced = _c10d.reduce_scatter_tensor(unreduced, "sum", config.shard_world, config.shard_group)
    _in_flight[reduced.untyped_storage().data_ptr()] = _InFlight(reduced, unreduced, config.grad_divisor)
    return reduced


def _address(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage starts; None for a traced tensor (no storage)."""
    if isinstance(t, FakeTensor) or t.is_meta:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _settle(address: int | None) -> None:
    entry = _in_flight.pop(address, None)
    if entry is not None:
        with torch.no_grad():
            _c10d.wait_tensor(entry.reduced)
            entry.reduced.div_(entry.divisor)


def settle_read(args: Any) -> None:
    """Wait for every in-flight gradient that a RaggedShard tensor among ``args`` (nested) views."""
    from .ragged_tensor import RaggedShardTensor

    for t in tree_flatten(args)[0]:
        if isinstance(t, RaggedShardTensor):
            address = _address(t._local)
            if address in _in_flight:
                _settle(address)
                if not _in_flight:
                    return


def is_in_flight(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` (a parameter's ``.grad``) is a view of a gradient still being reduced."""
    from .ragged_tensor import RaggedShardTensor, ragged_part

    piece = None if grad is None or not _in_flight else ragged_part(grad)
    return isinstance(piece, RaggedShardTensor) and _address(piece._local) in _in_flight


def settle_tensor(t: torch.Tensor) -> None:
    """Wait for the in-flight gradient ``t`` is (or views), if any."""
    if _in_flight:
        _settle(_address(t))


def settle_all() -> None:
    """Wait for every in-flight gradient."""
    for address in list(_in_flight):
        _settle(address)


def settle_before_collective(device: torch.device) -> None:
    """Before another collective on ``device``'s tensors: on CPU, wait for every in-flight gradient
    first, so that one collective is in flight at a time ([Note: one collective in flight on gloo]
    in passes/schedule.py)."""
    if _in_flight and device.type == "cpu":
        settle_all()
