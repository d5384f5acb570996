"""Check that every rank is about to issue the same collectives (a mismatch would hang, not fail)."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["check_ranks_agree"]


def _digest(items: Sequence[str]) -> int:
    return int.from_bytes(hashlib.sha256("\n".join(items).encode()).digest()[:7], "little")


def check_ranks_agree(items: Sequence[str], what: str) -> None:
    """Raise on every rank if ``items`` differ between ranks of the default group.

    One small all_gather of a digest (skipped without a process group and on the single-process
    fake group, whose collectives carry no data). The error lists this rank's items so the user
    can compare logs, e.g. a parameter used by the graph on some ranks only.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "fake":
        return
    mine = torch.tensor([_digest(items)], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if len({int(t) for t in every}) > 1:
        differing = [r for r, t in enumerate(every) if int(t) != int(every[0])]
        raise RuntimeError(
            f"ranks disagree on {what} (ranks {differing} differ from rank 0); this rank has: "
            f"{list(items)[:20]}{' ...' if len(items) > 20 else ''}. Every rank must run the same "
            f"model code path with the same parameters; make data-dependent branches that skip "
            f"parameters identical on all ranks"
        )
