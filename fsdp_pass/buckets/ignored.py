"""Parameters ``fully_shard(..., ignored_params=...)`` leaves whole, as FSDP2's ``ignored_params``.

[Note: ignored parameters stay whole]
FSDP2 neither shards an ignored parameter nor reduces its gradient: each rank keeps its own whole
tensor and its own local gradient (a framework that wants them synchronized does it itself). The
mark lives on the parameter object (an attribute, like the unshard flag), so the backend, which
shards every parameter a compiled graph uses that is not sharded yet, leaves marked ones as plain
graph inputs (compile/passes/pipeline.py), and a later ``fully_shard`` of an enclosing module skips them.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["is_ignored", "mark_ignored"]

_IGNORED_ATTR = "_fsdp_pass_ignored"


def mark_ignored(params: Iterable[torch.Tensor]) -> None:
    """Mark ``params`` to be left whole by ``fully_shard`` and the backend."""
    for p in params:
        setattr(p, _IGNORED_ATTR, True)


def is_ignored(p: torch.Tensor) -> bool:
    """Whether ``p`` was given to ``fully_shard``'s ``ignored_params``."""
    return getattr(p, _IGNORED_ATTR, False)
