"""Optimizers step sharded parameters with list (``_foreach_``) kernels when the user left the choice open.

[Note: list kernels for sharded parameters]
``torch.optim`` optimizers pick their implementation when ``foreach=None`` (the default): on CPU the
single-tensor loop, which issues about ten ops per parameter. On RaggedShard parameters every op
is a Python ``__torch_dispatch__`` call, so that loop costs several times a plain tensor's step.
The ``_foreach_`` implementation issues the same ops once per parameter list; dispatch unwraps the
lists to their local pieces and runs one list kernel on them. The math is the same op for op, so
the results are bitwise equal to the single-tensor loop (``tests/test_optim.py`` checks it). For a
step whose parameter groups hold only sharded parameters and left ``foreach`` at None (not fused,
not differentiable), a step pre-hook sets ``foreach=True`` and a post-hook puts None back: the
user's configuration, and its state dict, stay as they were.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .dbuffer import is_sharded
from .ragged_tensor import RaggedShardTensor

__all__ = ["install_list_kernels_for_sharded_parameters"]

_OPTED = "_fsdp_pass_opted_foreach"  # on a param group: foreach was None and is True for this step
_handles: tuple | None = None


def install_list_kernels_for_sharded_parameters() -> None:
    """Register the step hooks (once per process)."""
    global _handles
    if _handles is None:
        _handles = (register_optimizer_step_pre_hook(_opt_in), register_optimizer_step_post_hook(_opt_out))


# optimizer → {id(a group's params list): its length when every parameter in it was found sharded}. A
# sharded parameter stays sharded, so the full scan runs once per group, not at every step; a "no" is
# not kept (parameters may be sharded later) and its scan stops at the first plain parameter.
_all_sharded: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, int]]" = weakref.WeakKeyDictionary()


def _only_sharded(optimizer: torch.optim.Optimizer, params: list) -> bool:
    known = _all_sharded.setdefault(optimizer, {})
    if known.get(id(params)) == len(params):
        return True
    if all(isinstance(p, RaggedShardTensor) and is_sharded(p) for p in params):
        known[id(params)] = len(params)
        return True
    return False


def _opt_in(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        if ("foreach" in group and group["foreach"] is None and not group.get("fused")
                and not group.get("differentiable") and group["params"]
                and _only_sharded(optimizer, group["params"])):
            group["foreach"] = True
            group[_OPTED] = True


def _opt_out(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        if group.pop(_OPTED, False):
            group["foreach"] = None
