"""Optimizers step sharded parameters with list (``_foreach_``) kernels when the user left the choice
open, on optimizer states kept in flat per-bucket buffers.

[Note: list kernels for sharded parameters]
``torch.optim`` optimizers pick their implementation when ``foreach=None`` (the default): on CPU the
single-tensor loop, which issues about ten ops per parameter. On RaggedShard parameters every op
is a Python ``__torch_dispatch__`` call, so that loop costs several times a plain tensor's step.
The ``_foreach_`` implementation issues the same ops once per parameter list. For a step whose
parameter groups hold only sharded parameters and left ``foreach`` at None (not fused, not
differentiable), a step pre-hook sets ``foreach=True`` and a post-hook puts None back: the user's
configuration, and its state dict, stay as they were.

Dispatch then runs each elementwise list op once per *bucket*, not once per parameter: the
parameters are pieces of their bucket's shard, the gradients pieces of its gradient shard, and a
step post-hook (and ``load_state_dict``) moves every state tensor in a parameter's layout
(``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``: what ``zeros_like(p)`` or a
gradient's clone made) into one zero-padded buffer per bucket and state name, in the shard's
layout (:func:`flatten_states`). Neighbouring pieces of a bucket in every list argument become one
flat view; see [Note: one kernel per bucket] in tensor/flat_buffers.py. This holds for lists the
user asked for (``foreach=True``, ``zero_grad(set_to_none=False)`` of such an optimizer, the
gradient scaling of ``clip_grad_norm_``) and for the fused CPU kernels too. The math is the same op
for op and element for element, so the results are bitwise equal to the single-tensor loop
(``tests/test_optim.py`` checks it, and counts the kernels). Scalar states (``step``) stay as they are.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..tensor import flat_buffers
from ..tensor.ragged_tensor import RaggedShardTensor, bucket_of, is_sharded, over_pieces, ragged_part

__all__ = ["install_list_kernels_for_sharded_parameters"]

_OPTED = "_fsdp_pass_opted_foreach"  # on a param group: foreach was None and is True for this step
_handles: tuple | None = None


def install_list_kernels_for_sharded_parameters() -> None:
    """Register the step hooks (once per process)."""
    global _handles
    if _handles is None:
        _handles = (register_optimizer_step_pre_hook(_opt_in), register_optimizer_step_post_hook(_opt_out),
                    register_optimizer_step_post_hook(_flatten_states_after_step))


# optimizer → {id(a group's params list): (that list, its length) when every parameter in it was found
# sharded}. A sharded parameter stays sharded, so the full scan runs once per group, not at every step; a
# "no" is not kept (parameters may be sharded later) and its scan stops at the first plain parameter. The
# list itself is kept and compared by identity: a new list could reuse a freed one's id.
_all_sharded: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, tuple[list, int]]]" = \
    weakref.WeakKeyDictionary()


def _only_sharded(optimizer: torch.optim.Optimizer, params: list) -> bool:
    known = _all_sharded.setdefault(optimizer, {})
    seen = known.get(id(params))
    if seen is not None and seen[0] is params and seen[1] == len(params):
        return True
    if all(isinstance(p, RaggedShardTensor) and is_sharded(p) for p in params):
        known[id(params)] = (params, len(params))
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


# -- flat optimizer state --------------------------------------------------------------------------

_load_hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers whose load_state_dict flattens


def _flatten_states_after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer not in _load_hooked:
        _load_hooked.add(optimizer)
        optimizer.register_load_state_dict_post_hook(flatten_states)
    flatten_states(optimizer)


# optimizer → its state tensors at the last full look (id → weak reference): a step that made no new
# state skips the look. What was in place then still is (a state's piece never changes).
_looked_at: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, weakref.ref]]" = weakref.WeakKeyDictionary()


def flatten_states(optimizer: torch.optim.Optimizer) -> None:
    """Move ``optimizer``'s per-parameter states of sharded parameters into flat per-bucket buffers.

    A state tensor in a sharded parameter's layout (what ``zeros_like(p)`` or ``p.grad.clone()``
    made: a RaggedShard piece, inside a DTensor for TP/EP parameters) becomes a view of one
    zero-padded buffer per bucket and state name, in the bucket shard's layout, keeping its type;
    see [Note: one kernel per bucket]. Runs after every step (states appear in a parameter's first
    step) and after ``load_state_dict``; when no state tensor is new since the last time, it only
    checks that.
    """
    states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"] if p in optimizer.state]
    tensors = [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]
    looked = _looked_at.get(optimizer)
    if looked is not None and all((r := looked.get(id(v))) is not None and r() is v for v in tensors):
        return
    moves: dict[tuple, list] = {}  # (bucket, state name, dtype) → states to move
    homes: dict[tuple, set] = {}  # the same → the state buffers its states already view
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or not is_sharded(p):
                continue
            buf, name = bucket_of(p)
            slots = buf.slots
            slot = slots.index.get(name)
            if slot is None:  # no elements on this rank
                continue
            for key, value in state.items():
                part = ragged_part(value) if isinstance(value, torch.Tensor) else None
                if not isinstance(part, RaggedShardTensor) or not part.is_floating_point():
                    continue
                found = flat_buffers.slot_of(part.piece)
                if found is not None and found[1] == slot and found[0].slots is slots:
                    if found[0].is_state:
                        homes.setdefault((buf, key, part.dtype), set()).add(found[0])
                elif part._spec == ragged_part(p)._spec:
                    moves.setdefault((buf, key, part.dtype), []).append((state, key, value, slot))
    for (buf, key, dtype), moving in moves.items():
        slots = buf.slots
        home = homes.get((buf, key, dtype), ())
        flat = next(iter(home)).owner() if len(home) == 1 else None  # where the bucket's others are
        if flat is None:
            flat = torch.zeros(buf.shard.numel(), dtype=dtype, device=buf.shard.device)
            flat_buffers.register(flat, slots, is_state=True)
        for state, key_, value, slot in moving:
            state[key_] = _moved(value, flat[slots.starts[slot]:slots.starts[slot] + slots.sizes[slot]])
    _looked_at[optimizer] = {id(v): weakref.ref(v) for state in states for v in state.values()
                             if isinstance(v, torch.Tensor)}


@torch.no_grad()
def _moved(value: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``value`` (RaggedShard, or a DTensor around one) with its piece copied into ``piece``, same type."""
    part = ragged_part(value)
    piece.copy_(part.piece)
    moved = RaggedShardTensor(piece, part._spec)
    return over_pieces(moved, value._spec) if isinstance(value, DTensor) else moved
