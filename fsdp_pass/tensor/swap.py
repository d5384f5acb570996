"""Swap a parameter's contents in place, keeping the Python object (and so every reference to it)."""

from __future__ import annotations

import copyreg

import torch

__all__ = ["check_swappable", "in_live_graph", "swap_in_place"]


def swap_in_place(old: torch.Tensor, new: torch.Tensor) -> None:
    """Make ``old`` become ``new`` (class, attributes, storage) while keeping ``old``'s identity.

    The same steps as ``torch.utils.swap_tensors`` without its weakref check: while compiling,
    Dynamo and the fake-tensor memo hold weak references to parameters. Identity is kept, so those
    references stay valid. Optimizers built before sharding keep holding the right objects.
    """
    check_swappable(old, "parameter")
    check_swappable(new, "replacement")
    slots = set(copyreg._slotnames(old.__class__)) | set(copyreg._slotnames(new.__class__))
    old.__class__, new.__class__ = new.__class__, old.__class__
    old.__dict__, new.__dict__ = new.__dict__, old.__dict__
    for slot in slots:
        a, b = getattr(old, slot, _MISSING), getattr(new, slot, _MISSING)
        for t, v in ((old, b), (new, a)):
            if v is _MISSING:
                if hasattr(t, slot):
                    delattr(t, slot)
            else:
                setattr(t, slot, v)
    torch._C._swap_tensor_impl(old, new)


def check_swappable(t: torch.Tensor, what: str) -> None:
    """Raise if ``t`` cannot be swapped in place because other tensors (views, autograd) still alias it."""
    if t._use_count() > 2 or (t._use_count() == 2 and not t.is_leaf):
        raise RuntimeError(
            f"cannot shard {what}: other tensors still alias it (use count {t._use_count()}); "
            f"shard before running backward, or drop references to views of the parameter. If a framework wrapped "
            f"the model in DistributedDataParallel: fsdp_pass already synchronizes gradients, do not wrap it "
            f"(docs/integrations.md)"
        )


def in_live_graph(t: torch.Tensor) -> bool:
    """Whether an autograd graph not yet run backward holds leaf ``t``'s gradient accumulator: a forward
    used ``t`` before the swap, and its backward would accumulate into the contents swapped out
    ([Note: a parameter used before it was sharded] in eager/calls.py). The accumulator is the second
    owner of a leaf's contents (``torch.utils.swap_tensors`` reads the count the same way); the second owner
    may also be a view kept from a ``no_grad`` block, which holds its base: holding the accumulator tells
    them apart, since only one made here adds an owner."""
    if not (t.is_leaf and t.requires_grad and t._use_count() == 2):
        return False
    edge = torch.autograd.graph.get_gradient_edge(t)  # the live graph's accumulator, or a new one held here
    held_by_a_graph = t._use_count() == 2
    del edge
    return held_by_a_graph


_MISSING = object()
