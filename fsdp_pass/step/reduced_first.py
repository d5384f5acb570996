"""``step_reduced_first``: an optimizer step that starts on the gradients already reduced.

[Note: the reduced gradients are stepped first]
With ``overlap_last_reduce`` ([Note: the last reduce-scatter overlaps the optimizer step] in
step/deferred_reduce.py) backward returns while the reduce-scatter of the bucket its graph gathered
first (a whole model's embedding) is still in flight. A foreach or fused optimizer reads every
gradient in its first kernel, so ``optimizer.step()`` waits for it almost at once. With
``step_reduced_first`` on, the user's own ``optimizer.step()`` runs the optimizer twice instead: first
over the parameters whose gradients are reduced (every other bucket), while the transfer finishes,
then over the rest. Nobody wraps the optimizer; torch's public step hooks do it:

* a global step pre-hook (registered once, when the first graph with the option compiles) sees every
  optimizer's step. It returns at once unless a gradient of a bucket with the option is in flight; so
  it is the hook that finds the optimizers holding those buckets, the first time one steps. It then
  narrows each param group to the reduced parameters, calls ``optimizer.step()`` (the first pass,
  every hook included; this hook sees the step is already split and returns), and leaves the groups
  narrowed to the parameters still in flight: the step that called it steps those.
* a per-instance step post-hook, registered on an optimizer the first time its step is split, puts
  its whole groups back. Instance post-hooks run before global ones, so the next step's gathers
  (prefetch_next_step's global post-hook) see the whole groups.

A step whose own call raises keeps its narrowed groups until the next step's pre-hook restores them.
A step given a closure (LBFGS and other closure-based optimizers re-evaluate the loss) is not split.

The two passes compute exactly what one step computes for an optimizer whose update of a parameter
reads only that parameter, its gradient, its own state and its group's settings: torch's AdamW, Adam
and SGD (foreach, fused or for-loop), fsdp_pass's Muon, Shampoo and AdamW8bit
(``tests/test_step_boundary.py`` compares them bitwise). Not for optimizers that couple parameters in
one step (a global norm computed inside ``step``): turn the option off. On CPU the transfer is finished
before any other collective starts ([Note: one collective in flight on gloo] in
compile/passes/schedule.py): Muon, Shampoo and AdamW8bit redistribute the blocks a rank boundary cuts,
so with such blocks their first pass ends the overlap at its first redistribute. Optimizer step hooks
and a learning-rate scheduler's step counter see two calls. ``clip_grad_norm_`` before it reads every
gradient, so nothing is in flight any more and this is one step.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..tensor.in_flight import any_in_flight, is_in_flight
from ..tensor.ragged_tensor import RaggedShardTensor, bucket_of, is_sharded, ragged_part

__all__ = ["enable"]

# The buckets whose graphs have the option: only their gradients in flight split a step.
_opted: "weakref.WeakSet[object]" = weakref.WeakSet()
# Optimizer → its whole param lists, while one of its steps is split; "first" while the first pass runs.
_split: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()
_first_pass: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_restoring: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers with the post-hook
_hook = None  # the global pre-hook's handle


def enable(bucket) -> None:
    """Split the steps of optimizers holding ``bucket`` while its gradient is in flight (registers the
    global pre-hook once per process)."""
    global _hook
    _opted.add(bucket)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _first_pass:  # the first pass's own step
        return
    if optimizer in _split:  # the last split step raised before its post-hook ran
        _restore(optimizer)
    if not any_in_flight() or any(a is not None for a in (*args[1:], *kwargs.values())):
        return  # nothing to order, or a closure (accelerate passes closure=None: no closure)
    groups = optimizer.param_groups
    whole = [group["params"] for group in groups]
    waiting = {id(p) for params in whole for p in params if _reducing(p)}
    if not waiting or len(waiting) == sum(len(params) for params in whole):
        return
    if optimizer not in _restoring:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: _restore(opt))
        _restoring.add(optimizer)
    _split[optimizer] = whole
    _first_pass.add(optimizer)
    try:
        for group, params in zip(groups, whole):
            group["params"] = [p for p in params if id(p) not in waiting]
        optimizer.step()
    except BaseException:
        _restore(optimizer)
        raise
    finally:
        _first_pass.discard(optimizer)
    for group, params in zip(groups, whole):
        group["params"] = [p for p in params if id(p) in waiting]


def _restore(optimizer: torch.optim.Optimizer) -> None:
    """Put back the whole param groups of a split step (nothing for a step that was not split)."""
    if optimizer in _first_pass:
        return
    whole = _split.pop(optimizer, None)
    if whole is not None:
        for group, params in zip(optimizer.param_groups, whole):
            group["params"] = params


def _reducing(p: torch.Tensor) -> bool:
    """Whether ``p.grad`` views a gradient whose reduce-scatter is still in flight, in a bucket with the option."""
    piece = None if p.grad is None else ragged_part(p.grad)
    return (isinstance(piece, RaggedShardTensor) and is_in_flight(piece.piece) and is_sharded(p)
            and bucket_of(p)[0] in _opted)
