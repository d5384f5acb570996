"""One Inductor compile per graph across the processes of a test run (test ranks only).

[Note: one Inductor compile per graph across ranks]
The ranks of a data-parallel test compile the same graphs at the same moment: the per-rank graphs are
identical (same shapes, same collectives over the same group names), so their FX-graph cache keys are
too. Without coordination every rank lowers and generates code for every graph itself, and only the
C++ kernels are built once (Inductor locks each kernel file). On a 2-core machine with 2 to 4 ranks
that duplicated lowering was about a third of a cold multi-rank Inductor test's CPU time (a 2-rank
llama, fresh cache: 80 → 58 CPU seconds). Here a rank that computes a key it is the first to reach
takes a file lock named by the key for its whole compile; a rank that computes the same key waits on
the lock and then finds the finished graph in Inductor's FX-graph cache. Only Inductor's own cache
hands the graph over, so each rank runs exactly what a warm cache would give it. A rank holds at most
one such lock, and never across a collective (compiles do not communicate), so waits cannot form a
cycle; a rank that dies releases its lock with its file descriptor.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["compile_each_graph_once"]

_installed = False


def compile_each_graph_once() -> None:
    """Serialize Inductor compiles of one FX-graph cache key across processes (idempotent)."""
    global _installed
    if _installed:
        return
    import filelock
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    held = threading.local()  # .locks: one slot per running _compile_fx_inner call (its key's lock, or None)
    prepare_key = FxGraphCache.prepare_key
    compile_inner = compile_fx._compile_fx_inner

    def prepare_key_and_lock(*args: Any, **kwargs: Any):
        key_info, cache_info = prepare_key(*args, **kwargs)
        slots = getattr(held, "locks", None)
        if key_info is not None and slots and slots[-1] is None:
            path = os.path.join(cache_dir(), "compile_locks", f"{key_info[0]}.lock")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            lock = filelock.FileLock(path)
            lock.acquire()
            slots[-1] = lock  # the cache lookup comes next: after a wait, it finds the other process's graph
        return key_info, cache_info

    def compile_inner_locked(*args: Any, **kwargs: Any):
        slots = held.__dict__.setdefault("locks", [])
        slots.append(None)
        try:
            return compile_inner(*args, **kwargs)
        finally:
            lock = slots.pop()
            if lock is not None:
                lock.release()

    FxGraphCache.prepare_key = staticmethod(prepare_key_and_lock)
    compile_fx._compile_fx_inner = compile_inner_locked
    _installed = True
