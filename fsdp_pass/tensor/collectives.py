"""The few collectives RaggedShard tensors need, over one process group, in forms gloo accepts.

Each helper takes ``group=None`` to mean *no communication* (a single process, ``mesh=None``) — not
torch's default world group — and also skips communication when the group has one rank.

They issue torch's functional collectives (``torch.ops._c10d_functional``) and wait on them at once:
that runs eagerly on gloo and NCCL, and the same code also traces under ``torch.compile``. On CPU a
gradient's reduce-scatter left in flight (``overlap_last_reduce``) is finished first ([Note: one
collective in flight on gloo] in compile/passes/schedule.py).

Timeouts: none of these helpers has a timeout of its own. Every call relies on the timeout of the
process group it runs on (``init_process_group(timeout=...)`` / ``new_group(timeout=...)``): a
peer that never joins makes the wait raise after that timeout instead of hanging forever.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .in_flight import settle_before_collective

__all__ = ["all_gather_padded", "all_reduce_", "all_reduced", "all_to_all_uneven", "group_size"]

_c10d = torch.ops._c10d_functional


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 for ``None`` (no communication)."""
    return 1 if group is None else dist.get_world_size(group)


def all_reduced(tensor: torch.Tensor, group: ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """``tensor`` reduced over ``group`` (``op``: "sum", "max", "min", "avg"), as a new tensor (``tensor``
    itself when the group has one rank)."""
    if group_size(group) == 1:
        return tensor
    settle_before_collective(tensor.device)
    return _c10d.wait_tensor(_c10d.all_reduce(tensor, op, group.group_name))


def all_reduce_(tensor: torch.Tensor, group: ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (``op``: "sum", "max", "min", "avg"); returns it.

    Runs the out-of-place functional all_reduce and copies back: functionalization (aot_autograd)
    rejects the in-place functional op, and the copy is one pass over what was just reduced.
    """
    reduced = all_reduced(tensor, group, op)
    return tensor if reduced is tensor else tensor.copy_(reduced)


def all_to_all_uneven(
    local: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: ProcessGroup | None,
) -> torch.Tensor:
    """One uneven ``all_to_all_single`` of a flat tensor; zero-size splits allowed.

    ``send_splits[q]`` consecutive elements of ``local`` go to rank ``q``; the result holds
    ``recv_splits[q]`` elements from each rank ``q``, in rank order. This is the only uneven
    exchange gloo supports (its uneven list all_gather / all_to_all reject unequal sizes).
    Always returns a new tensor.
    """
    if group_size(group) == 1:
        return local.clone()
    settle_before_collective(local.device)
    out = _c10d.all_to_all_single(local.contiguous(), list(recv_splits), list(send_splits), group.group_name)
    return _c10d.wait_tensor(out)


def all_gather_padded(local: torch.Tensor, sizes: Sequence[int], group: ProcessGroup | None) -> torch.Tensor:
    """Concatenation of every rank's flat piece, where rank ``r``'s piece has ``sizes[r]`` elements.

    gloo only gathers equal sizes, so each piece is padded to the largest, gathered with one
    ``all_gather_into_tensor``, and the padding is cut out again. Zero-size pieces are fine.
    """
    world = group_size(group)
    if world == 1:
        return local.clone()
    width = max(sizes)
    if width == 0:
        return local.new_empty(0)
    settle_before_collective(local.device)
    padded = local.new_zeros(width)
    padded[: local.numel()] = local
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(padded, world, group.group_name))
    return torch.cat([gathered[r * width : r * width + size] for r, size in enumerate(sizes)])
