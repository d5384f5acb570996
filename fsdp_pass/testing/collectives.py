"""Count the collectives that actually run, for tests that assert communication per step."""

from __future__ import annotations

import collections

import torch

__all__ = ["CountCollectives"]


class CountCollectives:
    """Counts the functional collectives that actually run, compiled graphs and eager flushes alike,
    with the profiler (a dispatch mode would make Dynamo run the model eagerly instead)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def __enter__(self):
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        for event in self._prof.events():
            namespace, _, name = event.name.partition("::")
            if namespace == "_c10d_functional" and name != "wait_tensor":
                self.counts[name] += 1
        return False
