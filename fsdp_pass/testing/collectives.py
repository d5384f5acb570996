"""Count the collectives that actually run, and check where a graph waits for them, for tests that assert
communication per step."""

from __future__ import annotations

import collections

import torch
import torch.fx as fx

__all__ = ["CountCollectives", "quantized_exchanges_overlap"]


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


def quantized_exchanges_overlap(graph: fx.Graph) -> bool:
    """Whether, in a backward ``graph`` with ``quantized_reduce``, every bucket's exchange of quantized rows
    (an all_to_all) but the last stays in flight while the graph computes something (the next bucket's
    gradients, or their quantization) before waiting for it; False for fewer than two exchanges."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    exchanges = list(graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_to_all_single.default))

    def computes(node: fx.Node) -> bool:
        return isinstance(node.target, torch._ops.OpOverload) and not node.target.is_view and node.target is not wait

    in_flight = [nodes[position[a] + 1:position[next(u for u in a.users if u.target is wait)]] for a in exchanges[:-1]]
    return len(exchanges) > 1 and all(any(computes(n) for n in between) for between in in_flight)
