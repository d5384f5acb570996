"""A bucket's whole parameters for eager calls: gathered once per shard version, few buckets kept.

What dispatch runs an eager op on ([Note: eager calls on sharded parameters] in eager/calls.py): the
bucket's views of one eager all-gather (in the compiled graphs' ``param_dtype``). The gathered views
are kept on the bucket (:attr:`DBuffer.whole_views`) with the shard's version counter when gathered,
so an optimizer step or any in-place write to a piece makes them stale; only the
:data:`KEPT_BUCKETS` most recently used buckets keep theirs (a module's parameters share one
gather, and an eager forward holds the shards plus one gathered bucket, like FSDP2's reshard after
forward).
The buckets a backward reads are freed when it ends, as FSDP2 reshards after backward: the optimizer
step that follows makes them stale, and kept they would hold a bucket between steps.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable

import torch

from .mesh import check_mesh_is_current
from .uninitialized import check_gathered

__all__ = ["KEPT_BUCKETS", "drop_gathered", "gathered_views", "whole_views"]

KEPT_BUCKETS = 1  # buckets whose eager gather is kept for the next ops
_kept: deque[weakref.ref] = deque()  # buckets holding eager views, least recently used first
_drop_queued_in = -1  # the backward (autograd graph task id) whose end a drop_gathered is queued for


def whole_views(buf, before_gather: Callable[[Any], None]) -> dict[str, torch.Tensor]:
    """Every parameter of ``buf`` (a DBuffer) as a view of its eagerly gathered global buffer; ``before_gather(buf)``
    runs before a gather."""
    version = buf.shard._version
    cached = buf.whole_views
    if cached is not None and cached[0] != version:  # stale: gathered again below
        buf.whole_views = cached = None
    _unlist(buf)  # it goes back at the most recently used end
    if cached is None:
        while len(_kept) >= KEPT_BUCKETS:  # free before gathering: the peak is the kept buckets plus this one
            _drop(_kept.popleft())
        buf.whole_views = cached = (version, gathered_views(buf, before_gather)[1])
    _kept.append(weakref.ref(buf))
    backward = torch._C._current_graph_task_id()
    if backward != -1:  # read by a backward: freed at its end
        _drop_at_end_of(backward)
    return cached[1]


def gathered_views(buf, before_gather: Callable[[Any], None]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An eager all-gather of ``buf`` (in ``compute_dtype``, after ``before_gather(buf)``) and every parameter as a
    view of it, checked for uninitialized shards."""
    check_mesh_is_current(buf)  # before the first gather ([Note: wrappers around a sharded model])
    before_gather(buf)
    gathered = buf.all_gather(buf.compute_dtype)
    views = buf.views(gathered)
    check_gathered(buf, views)  # [Note: uninitialized shards]
    return gathered, views


def drop_gathered() -> None:
    """Free the gathered buckets kept for eager calls (they are also dropped as newer ones come)."""
    while _kept:
        _drop(_kept.popleft())


def _drop_at_end_of(backward: int) -> None:
    global _drop_queued_in
    if _drop_queued_in != backward:  # once per backward (one that raised never ran its callback)
        _drop_queued_in = backward
        torch.autograd.Variable._execution_engine.queue_callback(drop_gathered)


def _drop(ref: weakref.ref) -> None:
    buf = ref()
    if buf is not None:
        buf.whole_views = None


def _unlist(buf) -> None:
    """Take ``buf``, and buckets already freed, off the kept list."""
    for ref in [r for r in _kept if r() is buf or r() is None]:
        _kept.remove(ref)
