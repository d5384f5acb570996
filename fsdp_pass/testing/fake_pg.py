"""A single-process fake process group of any world size, for planning and tracing without processes.

Its collectives carry no data: use it to plan, rewrite and compile graphs at 64…16384 ranks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

__all__ = ["fake_process_group"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initialize a fake default process group of ``world_size`` ranks (this process is ``rank``) for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; plan in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
