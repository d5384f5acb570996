"""Gradient accumulation without communication: ``no_sync`` / ``set_requires_gradient_sync``.

Like FSDP2's ``set_requires_gradient_sync(False)`` and DDP's ``no_sync()``: the compiled backward of
a micro-batch run while a model does not sync reduce-scatters nothing; each rank sums its own
unsharded gradient per bucket, and the first backward after syncing is switched back on
reduce-scatters that sum once per bucket. See [Note: gradient accumulation without sync]
(runtime/dbuffer.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from .runtime.dbuffer import DBuffer, buffers_of, is_unsharded

__all__ = ["no_sync", "reduce_gradients", "set_requires_gradient_sync"]


def _buffers(model: nn.Module) -> list[DBuffer]:
    """The DBuffers holding ``model``'s sharded parameters (a compiled module's too: it shares them)."""
    if any(is_unsharded(p) for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__}'s parameters are inside an fsdp_pass.unshard block, where they are whole "
            f"tensors with no gradient sync to switch; leave the unshard block first"
        )
    found = buffers_of(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no sharded parameters, so there is no gradient sync to switch off; "
            f"shard it first with fsdp_pass.fully_shard(model), or run it once through "
            f"torch.compile(model, backend='vescale')"
        )
    return found


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Whether the compiled backward of ``model`` reduce-scatters gradients (True, the default).

    With False, each rank accumulates its unsharded gradient per bucket (one gathered-size buffer per
    trainable bucket, in ``reduce_dtype``); the first backward after it is set back to True
    reduce-scatters the sum once per bucket, so ``.grad`` holds what syncing every micro-batch
    gives. ``model`` is the compiled module or the original one. Eager (uncompiled) calls keep
    syncing their gradients at once.
    """
    for buf in _buffers(model):
        buf.gradient_sync = bool(requires_gradient_sync)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Run the micro-batches of the block without reduce-scattering gradients.

    Forward and backward of a micro-batch belong in the same block. The first backward after the
    block reduce-scatters the accumulated gradients with its own, once per bucket. Re-entrant; the
    previous state is restored on exit, also when the body raises.
    """
    buffers = _buffers(model)
    before = [buf.gradient_sync for buf in buffers]
    for buf in buffers:
        buf.gradient_sync = False
    try:
        yield
    finally:
        for buf, state in zip(buffers, before):
            buf.gradient_sync = state


def reduce_gradients(model: nn.Module) -> None:
    """Reduce-scatter now, once per bucket, the gradients ``model`` accumulated under ``no_sync``.

    For loops whose last backward also runs inside ``no_sync``: a pipeline schedule runs every
    micro-batch's backward in one call, so wrap ``schedule.step(...)`` in ``no_sync`` and call this
    before the optimizer step. Buckets with nothing pending are left alone.
    """
    buffers = _buffers(model)
    if not all(buf.gradient_sync for buf in buffers):
        raise ValueError(
            f"reduce_gradients({type(model).__name__}) was called while gradient sync is off; call it after "
            f"the no_sync block (or after set_requires_gradient_sync(model, True))"
        )
    for buf in buffers:
        buf.flush_pending()
