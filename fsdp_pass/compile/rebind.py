"""Which bucket shards a compiled graph runs on, for the parameters it is called with.

[Note: one graph for identical blocks]
Dynamo guards a parameter by its type and metadata, not by its identity. Once ``fully_shard`` has
sharded a model, every transformer block compiled on its own (``block.compile(backend="vescale")``)
passes the guards of the first block's graph, and Dynamo runs that one graph for all of them, with
each block's own parameters as inputs. The compiled function reads bucket shards, not parameters,
so it must take the shards of the parameters it is *called* with. :class:`ShardBinding` maps the
call's parameters to their buckets: when every bucket has the layout the graph was compiled for
(the same segments, each parameter at the same segment), the graph runs on those buckets' shards,
so one compiled graph serves n identical blocks. Otherwise (a block's parameters share a bucket
with other modules' parameters, laid out differently) the call is refused by returning None, and
the caller runs Dynamo's graph eagerly instead.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from ..buckets.dbuffer import DBuffer
from ..tensor.ragged_tensor import bucket_of, is_sharded
from ..buckets.gather import GatherConfig

__all__ = ["ShardBinding"]

_KEPT_BINDINGS = 256  # parameter sets remembered (a model has one per compiled region)


class ShardBinding:
    """The buckets a compiled graph was built for, and how to find the same layout for other parameters.

    Args:
        positions: where each parameter sits among the graph's inputs.
        params: the parameters the graph was compiled with, in ``positions`` order.
        buffers: the graph's buckets, in the order of its shard inputs.
        configs: each bucket's gather arguments, as compiled.
    """

    def __init__(
        self,
        positions: Sequence[int],
        params: Sequence[torch.Tensor],
        buffers: Sequence[DBuffer],
        configs: Sequence[GatherConfig],
    ) -> None:
        self.positions = list(positions)
        self.buffers = list(buffers)
        index_of_buffer = {id(b): j for j, b in enumerate(buffers)}
        self._slots: list[tuple[int, int] | None] = []  # per parameter: (bucket index, segment index), None if unread
        for p in params:
            buf, name = bucket_of(p)
            j = index_of_buffer.get(id(buf))
            self._slots.append(None if j is None else (j, buf.segment_index(name)))
        self._sizes = [b.segment_sizes() for b in buffers]
        # per bucket: the segments the graph reads; in the buckets it was compiled for, their names
        self._read_segments = [sorted({slot[1] for slot in self._slots if slot is not None and slot[0] == j})
                               for j in range(len(buffers))]
        self.reads = self.names_read(self.buffers)
        _note_compiled_reads(self.buffers, self.reads)
        self._configs = list(configs)
        self._params = [weakref.ref(p) for p in params]
        # ids of a call's parameters → (weak references to them, their buckets, the names read in each)
        self._known: dict[tuple[int, ...], tuple[list[weakref.ref], list[DBuffer], list[tuple[str, ...]]]] = {}

    def names_read(self, buffers: Sequence[DBuffer]) -> list[tuple[str, ...]]:
        """Per bucket of ``buffers`` (laid out as the graph's), the names of the parameters the graph reads
        there ([Note: the gradient state of a parameter] in buckets/dbuffer.py)."""
        read = []
        for buf, segments in zip(buffers, self._read_segments):
            names = [name for name, _ in buf.layout.segments()]
            read.append(tuple(names[i] for i in segments))
        return read

    def bind(self, args: Sequence) -> tuple[list[DBuffer], list[tuple[str, ...]]] | None:
        """The buckets to run on for a call with ``args`` and the names the graph reads in each; None when the
        parameters' buckets are laid out otherwise."""
        actual = [args[i] for i in self.positions]
        if all(ref() is a for ref, a in zip(self._params, actual)):
            return self.buffers, self.reads
        key = tuple(map(id, actual))
        known = self._known.get(key)
        if known is None or any(ref() is not a for ref, a in zip(known[0], actual)):
            buffers = self._match(actual)
            if buffers is None:
                return None
            if len(self._known) >= _KEPT_BINDINGS:
                self._known.pop(next(iter(self._known)))
            known = self._known[key] = ([weakref.ref(a) for a in actual], buffers, self.names_read(buffers))
            _note_compiled_reads(buffers, known[2])
        return known[1], known[2]

    def _match(self, actual: Sequence[torch.Tensor]) -> list[DBuffer] | None:
        found: list[DBuffer | None] = [None] * len(self.buffers)
        for a, slot in zip(actual, self._slots):
            if slot is None:
                continue
            if not is_sharded(a):
                return None
            j, segment = slot
            buf, name = bucket_of(a)
            if found[j] is None:
                config = self._configs[j]
                if (buf.segment_sizes() != self._sizes[j] or buf.dtype != self.buffers[j].dtype
                        or buf.config(config.param_dtype, config.reduce_dtype, config.fp8 is not None) != config):
                    return None
                found[j] = buf
            if buf is not found[j] or buf.segment_index(name) != segment:
                return None
        if any(b is None for b in found):
            return None
        return found


def _note_compiled_reads(buffers: Sequence[DBuffer], reads: Sequence[tuple[str, ...]]) -> None:
    """Tell each bucket which of its parameters a compiled graph runs on (for ``explain()``)."""
    for buf, names in zip(buffers, reads):
        buf.compiled_reads.update(names)
