"""``step_reduced_first``: an optimizer step that starts on the gradients already reduced.

With ``overlap_last_reduce`` ([Note: the last reduce-scatter overlaps the optimizer step] in
step/deferred_reduce.py) backward returns while the reduce-scatter of the bucket its graph gathered
first (a whole model's embedding) is still in flight. A foreach or fused optimizer reads every
gradient in its first kernel, so ``optimizer.step()`` waits for it almost at once. This step runs the
optimizer twice instead: first over the parameters whose gradients are reduced (every other bucket),
while the transfer finishes, then over the rest.

The two passes compute exactly what one step computes for an optimizer whose update of a parameter
reads only that parameter, its gradient, its own state and its group's settings: torch's AdamW, Adam
and SGD (foreach, fused or for-loop), fsdp_pass's Muon, Shampoo and AdamW8bit
(``tests/test_step_boundary.py`` compares them bitwise). On CPU the transfer is finished before any
other collective starts ([Note: one collective in flight on gloo] in compile/passes/schedule.py): Muon,
Shampoo and AdamW8bit redistribute the blocks a rank boundary cuts, so with such blocks their first
pass ends the overlap at its first redistribute. Optimizer step hooks and a learning-rate
scheduler's step counter see two calls. ``clip_grad_norm_`` before it reads every gradient, so
nothing is in flight any more and this is one ``optimizer.step()``.
"""

from __future__ import annotations

import torch

from ..tensor.in_flight import any_in_flight, is_in_flight
from ..tensor.ragged_tensor import RaggedShardTensor, ragged_part

__all__ = ["step_reduced_first"]


def step_reduced_first(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, over the parameters whose gradients are reduced first, then over those whose
    reduce-scatter is still in flight (one ``step()`` when none or all are).

    Not for optimizers that couple parameters in one step (LBFGS and other closure-based ones, a
    global norm computed inside ``step``): call their ``step()``.
    """
    if not any_in_flight():  # nothing to order: no walk over the parameters
        optimizer.step()
        return
    groups = optimizer.param_groups
    whole = [group["params"] for group in groups]
    waiting = {id(p) for params in whole for p in params if _reducing(p.grad)}
    if not waiting or len(waiting) == sum(len(params) for params in whole):
        optimizer.step()
        return
    try:
        for in_flight in (False, True):
            for group, params in zip(groups, whole):
                group["params"] = [p for p in params if (id(p) in waiting) == in_flight]
            optimizer.step()
    finally:
        for group, params in zip(groups, whole):
            group["params"] = params


def _reducing(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` (a parameter's ``.grad``) views a gradient whose reduce-scatter is still in flight."""
    piece = None if grad is None else ragged_part(grad)
    return isinstance(piece, RaggedShardTensor) and is_in_flight(piece.piece)
