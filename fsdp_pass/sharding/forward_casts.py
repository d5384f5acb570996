"""``MixedPrecisionPolicy``'s ``cast_forward_inputs`` and ``output_dtype`` on a ``fully_shard``-ed module.

As FSDP2 does it, per module given to ``fully_shard``: a forward pre-hook casts the floating-point
tensors among the forward's arguments to ``param_dtype`` (when ``cast_forward_inputs`` and a
``param_dtype`` are set), a forward hook casts the floating-point tensors of its output to
``output_dtype`` (when set). They run in eager calls; under ``torch.compile(module)`` torch 2.13
compiles the pre-hook as a frame of its own (a graph without parameters, next to the forward's
graph), and inside a compiled parent Dynamo traces them into the parent's graph. The hooks are
partials of module-level functions, so the module still pickles.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

__all__ = ["register_forward_casts"]


def _cast_floating(dtype: torch.dtype, value: Any) -> Any:
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    cast = functools.partial(_cast_floating, dtype)
    return tree_map(cast, args), tree_map(cast, kwargs)


def _cast_output(dtype: torch.dtype, module: nn.Module, args: tuple, output: Any) -> Any:
    return tree_map(functools.partial(_cast_floating, dtype), output)


def register_forward_casts(module: nn.Module, param_dtype: torch.dtype | None, output_dtype: torch.dtype | None,
                           cast_forward_inputs: bool) -> None:
    """Cast ``module``'s floating-point inputs to ``param_dtype`` and outputs to ``output_dtype``, as FSDP2's policy."""
    if cast_forward_inputs and param_dtype is not None:
        module.register_forward_pre_hook(functools.partial(_cast_inputs, param_dtype), with_kwargs=True)
    if output_dtype is not None:
        module.register_forward_hook(functools.partial(_cast_output, output_dtype))
