"""Ranks that share one compile cache compile each graph once between them (``options["shared_compile_cache"]``).

[Note: ranks compile a graph once between them]
Every rank of a data-parallel job compiles the same graphs: same shapes, same collectives over the
same group names, so the same Inductor FX-graph cache keys. Compiling at the same moment, they all
miss the cache and each one lowers, generates and builds every graph. With a cache folder all ranks
see (``TORCHINDUCTOR_CACHE_DIR`` on a node-local or shared file system), rank 0 compiles each graph
first and the other ranks wait for it at a barrier; then they compile the same graph and find
Inductor's output in torch's own FX-graph cache. The backward graph is compiled inside the same
turn (``force_non_lazy_backward_lowering``), before the first collective runs, so the wait never
sits between two ranks' collectives. Dynamo and AOTAutograd still trace on every rank: only
Inductor's lowering, code generation and C++ builds are shared. A second launch with the cache kept
(a warm start) finds every graph there.

Without a shared folder the others gain nothing and wait for rank 0 first, which is why it is an option.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["compile_in_turn"]


@contextlib.contextmanager
def compile_in_turn(enabled: bool) -> Iterator[None]:
    """Around one graph's compile: rank 0 compiles first, the other ranks after it (a no-op when not
    ``enabled`` or on one rank). The barrier waits under the process group's timeout."""
    if not (enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    first = dist.get_rank() == 0
    if not first:
        dist.barrier()  # rank 0's graph is in the cache once it arrives
    try:
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            yield
    finally:
        if first:
            dist.barrier()  # also when rank 0 failed: the others then compile, and fail, on their own
