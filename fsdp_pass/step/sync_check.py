"""Refuse to step an optimizer whose plain (unsharded) parameters have gradients that differ across ranks.

[Note: parameters left out of sharding]
Compiling each block on its own (``for b in model.layers: b.compile(backend="vescale")``) shards only
the parameters the compiled blocks use. The embedding and the head stay plain parameters; each rank
computes their gradients from its own batch and nothing averages them, so the ranks would silently
train different models. ``fsdp_pass.fully_shard(model)`` before compiling the blocks shards them too
(they then run through the eager path, eager/calls.py). To catch the case where nobody did,
the first optimizer step that updates sharded parameters compares, once per optimizer, the
gradients of its plain parameters across the data-parallel ranks: DDP or a manual all-reduce makes
them agree; if they differ, every rank raises an error that names the parameter and the fix. A model
compiled whole never gets here: every parameter of a compiled module is sharded, read by a graph or not
([Note: parameters no graph reads] in compile/passes/unread.py); only modules outside every compiled
or sharded module do.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.tensor import DTensor

from ..buckets.ignored import is_ignored
from ..tensor.ragged_tensor import bucket_of, is_sharded

__all__ = ["install_plain_gradient_check"]

_checked: weakref.WeakSet = weakref.WeakSet()  # optimizers whose plain parameters were checked (or have none)
_handle = None


def install_plain_gradient_check() -> None:
    """Register the check as a global optimizer step pre-hook (once per process)."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_check_plain_gradients)


def _check_plain_gradients(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _checked:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = next((p for p in params if is_sharded(p)), None)
    plain = [p for p in params if p.requires_grad and not is_sharded(p) and not isinstance(p, DTensor)
             and not is_ignored(p)]  # [Note: ignored parameters stay whole]: their gradients are the user's
    if sharded is None or not plain:
        _checked.add(optimizer)
        return
    with_grads = [p for p in plain if p.grad is not None]
    if not with_grads:
        return  # nothing computed yet: look again at the next step
    groups = bucket_of(sharded)[0].mesh.data_parallel_groups()
    if groups:
        _compare_across_ranks(with_grads, groups)
    _checked.add(optimizer)


@torch.no_grad()
def _compare_across_ranks(params: list[torch.Tensor], groups: list[dist.ProcessGroup]) -> None:
    # Two float64 moments per gradient: equal gradients give equal moments on every rank.
    mine = torch.stack([torch.stack([p.grad.double().sum(), p.grad.double().square().sum()]) for p in params])
    for group in groups:
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        every = torch.stack(gathered)
        differs = ~torch.isclose(every, mine.expand_as(every), rtol=1e-6, atol=1e-12).all(dim=(0, 2))
        if differs.any():
            p = params[int(differs.nonzero()[0])]
            raise RuntimeError(
                f"parameter {_name_of(p)!r} (shape {tuple(p.shape)}) is not sharded and its gradient differs across "
                f"the data-parallel ranks: nothing averages it, so the ranks would train different models. This "
                f"happens when only some modules are compiled with backend='vescale' (e.g. each transformer "
                f"block). Call fsdp_pass.fully_shard(model) on the whole model before compiling its parts, or "
                f"compile the whole model, or synchronize these parameters yourself (DDP, all_reduce)"
            )


def _name_of(p: torch.Tensor) -> str:
    """The longest qualified name any live module gives ``p`` (the root's view), for the error message."""
    best = ""
    for obj in gc.get_objects():
        if isinstance(type(obj), type) and issubclass(type(obj), nn.Module):  # type(): dead weak proxies raise
            for name, q in obj.named_parameters(remove_duplicate=False):
                if q is p and len(name) > len(best):
                    best = name
    return best or "<unnamed>"
