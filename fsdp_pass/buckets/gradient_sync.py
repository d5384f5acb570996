"""Gradient sync settings: ``no_sync`` / ``set_requires_gradient_sync`` and ``set_gradient_divide_factor``.

Like FSDP2's ``set_requires_gradient_sync(False)`` and DDP's ``no_sync()``: the compiled backward of
a micro-batch run while a model does not sync reduce-scatters nothing; each rank sums its own
unsharded gradient per bucket, and the first backward after syncing is switched back on
reduce-scatters that sum once per bucket. See [Note: gradient accumulation without sync]
(buckets/dbuffer.py). Like FSDP2's ``set_gradient_divide_factor``: what the summed gradient is
divided by. Both may be set before the backend has sharded the model ([Note: settings recorded
before sharding] in buckets/settings.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn

from ..options import check_divide_factor
from . import settings as bucket_settings
from .dbuffer import DBuffer, buffers_of, buffers_of_parameters, flush_agreed, is_unsharded
from ..tensor.ragged_tensor import bucket_of, is_sharded

__all__ = ["apply_to_buckets", "no_sync", "reduce_gradients", "set_gradient_divide_factor", "set_requires_gradient_sync"]


def _buffers(model: nn.Module) -> list[DBuffer]:
    """The DBuffers holding ``model``'s sharded parameters (a compiled module's too: it shares them)."""
    _refuse_inside_unshard(model)
    found = buffers_of(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no sharded parameters, so there is no gradient sync to switch off; "
            f"shard it first with fsdp_pass.fully_shard(model), or run it once through "
            f"torch.compile(model, backend='vescale')"
        )
    return found


def _refuse_inside_unshard(model: nn.Module) -> None:
    if any(is_unsharded(p) for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__}'s parameters are inside an fsdp_pass.unshard block, where they are whole "
            f"tensors with no gradient sync to switch; leave the unshard block first"
        )


def _targets(model: nn.Module, call: str, parameters: Iterable[torch.Tensor] | None = None
             ) -> tuple[list[DBuffer], list[torch.Tensor]]:
    """The buckets of ``model``'s sharded parameters (only of ``parameters`` when given), and those of
    them the backend has not sharded yet."""
    _refuse_inside_unshard(model)
    params = list(model.parameters() if parameters is None else parameters)
    if not params:
        raise ValueError(f"{call}: {type(model).__name__} has no parameters")
    return buffers_of_parameters(params), [p for p in params if not is_sharded(p)]


def apply_to_buckets(model: nn.Module, call: str, parameters: Iterable[torch.Tensor] | None = None,
                     **setting: Any) -> None:
    """Give the buckets of ``model``'s parameters (only of ``parameters`` when given) a setting (a keyword of
    :meth:`DBuffer.apply_settings`); parameters not sharded yet keep it for their bucket ([Note: settings
    recorded before sharding]). ``call`` names the caller in messages."""
    buffers, waiting = _targets(model, call, parameters)
    for buf in buffers:
        buf.apply_settings(**setting)
    bucket_settings.record(waiting, **setting)


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool, *,
                               parameters: Iterable[torch.Tensor] | None = None) -> None:
    """Whether the compiled backward of ``model`` reduce-scatters gradients (True, the default).

    With False, each rank accumulates its unsharded gradient per bucket (one gathered-size buffer per
    trainable bucket, in ``reduce_dtype``); the first backward after it is set back to True
    reduce-scatters the sum once per bucket, so ``.grad`` holds what syncing every micro-batch
    gives. ``model`` is the compiled module or the original one, sharded or not yet (the backend
    shards at the first call and applies the setting then). Eager (uncompiled) calls keep
    syncing their gradients at once. ``parameters``: only these of ``model``'s parameters (FSDP2's
    ``recurse=False``: a module's own).
    """
    apply_to_buckets(model, "set_requires_gradient_sync", parameters, gradient_sync=bool(requires_gradient_sync))


def set_gradient_divide_factor(model: nn.Module, factor: float, *,
                               parameters: Iterable[torch.Tensor] | None = None) -> None:
    """Divide ``model``'s gradients, summed over the data-parallel ranks, by ``factor`` (FSDP2's name).

    The default is the data-parallel degree (a mean, like DDP); ``1.0`` gives the sum, for a loss
    already divided by the global token count (torchtitan). Applies to compiled, eager, ``no_sync``
    and HSDP reductions. Set it before the first compiled call, or on a model not sharded yet; a
    graph compiled with another factor refuses to run. Also ``options={"gradient_divide_factor": f}``.
    ``parameters``: only these of ``model``'s parameters (an FSDP2 module's own).
    """
    factor = check_divide_factor(factor, "set_gradient_divide_factor's factor")
    apply_to_buckets(model, "set_gradient_divide_factor", parameters, gradient_divide_factor=factor)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Run the micro-batches of the block without reduce-scattering gradients.

    Forward and backward of a micro-batch belong in the same block. The first backward after the
    block reduce-scatters the accumulated gradients with its own, once per bucket. Re-entrant; the
    previous state is restored on exit, also when the body raises. The model may be sharded by
    its first compiled call inside the block.
    """
    buffers, waiting = _targets(model, "no_sync")
    before = [buf.gradient_sync for buf in buffers]
    waiting_before = [bucket_settings.recorded(p, "gradient_sync", True) for p in waiting]
    set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        for buf, state in zip(buffers, before):
            buf.apply_settings(gradient_sync=state)
        for p, state in zip(waiting, waiting_before):
            if is_sharded(p):  # sharded inside the block
                bucket_of(p)[0].apply_settings(gradient_sync=state)
            else:
                bucket_settings.record([p], gradient_sync=state)


def reduce_gradients(model: nn.Module) -> None:
    """Reduce-scatter now, once per bucket, the gradients ``model`` accumulated under ``no_sync``.

    For loops whose last backward also runs inside ``no_sync``: a pipeline schedule runs every
    micro-batch's backward in one call, so wrap ``schedule.step(...)`` in ``no_sync`` and call this
    before the optimizer step. Buckets with nothing pending on any rank are left alone (one all-reduce
    agrees which: a bucket that only some ranks' eager calls reached is reduced on every rank).
    """
    buffers = _buffers(model)
    if not all(buf.gradient_sync for buf in buffers):
        raise ValueError(
            f"reduce_gradients({type(model).__name__}) was called while gradient sync is off; call it after "
            f"the no_sync block (or after set_requires_gradient_sync(model, True))"
        )
    flush_agreed(buffers)
