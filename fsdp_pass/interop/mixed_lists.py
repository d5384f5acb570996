"""List ops over tensor-parallel DTensor parameters and RaggedShard ones, whichever comes first.

[Note: list ops mixing DTensor and RaggedShard parameters]
Under FSDP over TP/EP ([Note: FSDP over TP/EP] in sharding/materialize.py) a model has two kinds of
sharded parameters: DTensors (TP/EP) whose local tensors are RaggedShard pieces, and plain
RaggedShard tensors. Optimizers and ``clip_grad_norm_`` group tensors by device and dtype only, so one
``_foreach_*`` (or fused optimizer) call gets both kinds. Python dispatch goes to the first tensor's
type: when a RaggedShard tensor leads, RaggedShard dispatch splits the list by kind
(``tensor/dispatch.py``'s ``split_off_dtensor_entries``); when a DTensor leads, DTensor's dispatch refuses
the list ("got mixed torch.Tensor and DTensor"). That happens as soon as a TP parameter is the
model's first (torchtitan's plans shard the embedding), and on GPUs, where ``foreach`` is the default.

So, once a model has DTensor parameters to shard, every list op gets a DTensor custom handler
(DTensor's documented ``_custom_op_handlers`` table, which its loss-parallel and context-parallel
code use too): a list with non-DTensor entries is split the same way; a list of DTensors only runs
DTensor's own dispatch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..tensor.dispatch import bind_arguments, dtensor_entries, is_list_op, split_off_dtensor_entries

__all__ = ["install_mixed_list_handlers"]

_installed: list[Any] = []  # the list-op overloads handled (filled once per process)


def _list_ops() -> list[Any]:
    """Every overload RaggedShard dispatch runs as a list op (``tensor/dispatch.py``'s ``is_list_op``), from the
    registered schemas: ``dir(torch.ops.aten)`` lists only the ops resolved so far."""
    ops = []
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith(("aten::_foreach_", "aten::_fused_")):
            op = getattr(getattr(torch.ops.aten, schema.name[len("aten::"):]), schema.overload_name or "default")
            if is_list_op(op):
                ops.append(op)
    return ops


@contextlib.contextmanager
def _dtensor_default(op) -> Any:
    """DTensor's own dispatch for ``op`` while inside (the handler steps aside)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        yield
    finally:
        handlers[op] = handler


def _has_other_entries(args: tuple, kwargs: dict) -> bool:
    """Whether some entry holds no DTensor: a RaggedShard or plain parameter's. Entries of DTensor
    parameters may hold plain tensors too (a fused optimizer's 0-dim steps): when every entry has a
    DTensor, DTensor's own dispatch runs the op."""
    return not all(dtensor_entries((*args, *kwargs.values())))


def _handle(op, args: tuple, kwargs: dict) -> Any:
    if _has_other_entries(args, kwargs):
        return split_off_dtensor_entries(op, bind_arguments(op, args, kwargs))
    with _dtensor_default(op):
        return op(*args, **kwargs)


def install_mixed_list_handlers() -> None:
    """Register the handler for every list op (once per process)."""
    if _installed:
        return
    _installed.extend(_list_ops())
    DTensor._op_dispatcher._custom_op_handlers.update({op: _handle for op in _installed})
