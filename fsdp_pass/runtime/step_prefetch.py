"""The next step's first all-gather, issued when the optimizer step ends.

[Note: the next step's first gather starts at the optimizer step]
A compiled forward issues its first bucket's all-gather (a whole model's embedding) before any
compute, and nothing in the graph hides it. With ``prefetch_next_step`` on, the optimizer hides it:

* every compiled graph of several buckets with the option names the bucket it gathers first and
  that gather's arguments when it runs (:func:`note_first`);
* a global optimizer step post-hook issues that all-gather, without a wait, when an optimizer that
  holds one of the bucket's parameters finishes its step (so after the last write to the shard that
  step makes), for the first bucket named since that optimizer's last step; it records the shard's
  version counter. A second optimizer holding the same bucket issues it again (the first one's
  copy may be stale);
* the next compiled call of a graph that gathers the bucket first takes it (:func:`take`): it runs
  the graph variant whose ``gather_bucket`` for that bucket takes the gathered buffer as an input
  (passes/rewrite.py :func:`prefetching_variant`) instead of gathering it again. The values are the
  graph's own: the same cast (or FP8 pack) of the same shard, the same collective.

Stale is never read. Any write to the shard after the gather was issued (a user's in-place write to
a parameter, ``load_state_dict``, ``fsdp_pass.unshard(writeback=True)``: every write to a piece bumps
the shard's version, runtime/ragged_dispatch.py ``count_writes``) makes the local copy stale. The
decision must be the same on every rank: a rank that gathers again while another does not would
pair the collectives wrongly, and a write on one rank makes every rank's copy of that rank's piece
stale. So :func:`take` first agrees on it: one all-reduce of one integer over the bucket's shard
group (about 0.3 ms on gloo, against the several ms of the gather it saves). If any rank's shard
changed, every rank drops the prefetched buffer and runs the graph that gathers.

A graph that gathers the bucket but does not take it (the variant that accumulates without sync, a
graph that gathers it later than first) drops it (a wait, no collective: the collective was issued on
every rank). The buffer (``m·S`` elements in ``param_dtype``) is held from the end of the step to the
next forward, where it would be gathered anyway.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .gather import GatherConfig, finish_all_gather, start_all_gather

__all__ = ["discard", "enable", "in_flight", "note_first", "take"]

_c10d = torch.ops._c10d_functional


class _Prefetch(NamedTuple):
    buffer: weakref.ref  # the DBuffer gathered
    config: GatherConfig  # the gather's arguments in the graph that named it
    version: int  # the shard's version counter when the gather was issued
    started: torch.Tensor  # start_all_gather's output, not waited on yet


class _Target(NamedTuple):
    buffer: weakref.ref  # a DBuffer some graph gathers first
    config: GatherConfig


_named: dict[int, _Target] = {}  # id(DBuffer) → target, in the order graphs named them since they were issued
_in_flight: dict[int, _Prefetch] = {}  # id(DBuffer) → its gather in flight
_hook = None  # the optimizer post-hook's handle, registered by the first graph with the option


def enable() -> None:
    """Register the optimizer step post-hook (once per process)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_after_step)


def in_flight() -> bool:
    return bool(_in_flight)


def note_first(buf, config: GatherConfig) -> None:
    """A graph with the option runs, gathering ``buf`` first with ``config``."""
    named = _named.get(id(buf))
    if named is None or named.buffer() is not buf:
        _named[id(buf)] = _Target(weakref.ref(buf), config)


def _held_by(optimizer: torch.optim.Optimizer) -> list[int]:
    """The named targets ``optimizer`` holds a parameter of, in the order they were named."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    held = []
    for key, target in list(_named.items()):
        buf = target.buffer()
        if buf is None:
            del _named[key]
        elif any(id(p) in ids for p in buf.params.values()):
            held.append(key)
    return held


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    held = _held_by(optimizer)
    if not held:
        return
    target = _named[held[0]]
    for key in held:
        del _named[key]
    buf = target.buffer()
    _discard(id(buf))
    with torch.no_grad():
        started = start_all_gather(buf.shard.detach(), target.config)
    _in_flight[id(buf)] = _Prefetch(target.buffer, target.config, buf.shard._version, started)


def _discard(key: int) -> None:
    """Drop the gather in flight for a bucket, if any (wait for it: its collective was issued on every rank)."""
    entry = _in_flight.pop(key, None)
    if entry is not None:
        _c10d.wait_tensor(entry.started)


def discard(buffers) -> None:
    """Drop the gathers in flight for any of ``buffers``."""
    for buf in buffers:
        if id(buf) in _in_flight:
            _discard(id(buf))


def take(buf, config: GatherConfig) -> torch.Tensor | None:
    """The gathered buffer of ``buf`` if one is in flight for it, with ``config``, and no rank's shard
    changed since; else None (and what was in flight for it is dropped). Every rank of the bucket's
    shard group must call it at the same point when one is in flight (it agrees with them: one small
    all-reduce)."""
    entry = _in_flight.get(id(buf))
    if entry is None:
        return None
    if entry.buffer() is not buf or entry.config != config:
        _discard(id(buf))
        return None
    del _in_flight[id(buf)]
    stale = torch.tensor([int(buf.shard._version != entry.version)], dtype=torch.int32, device=buf.shard.device)
    stale = _c10d.wait_tensor(_c10d.all_reduce(stale, "max", config.shard_group))
    gathered = finish_all_gather(entry.started, buf.shard.numel(), config)
    return None if stale.item() else gathered
