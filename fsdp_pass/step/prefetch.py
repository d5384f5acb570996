"""The next step's first all-gathers, issued when the optimizer step ends.

[Note: the next step's first gather starts at the optimizer step]
A compiled forward issues its first buckets' all-gathers (a whole model's embedding, then the first
layer: ``prefetch`` + 1 of them are in flight before the first one is waited on) before any compute,
and nothing in the graph hides them. With ``prefetch_next_step`` on, the optimizer step hides them:

* every compiled graph with the option names, when it runs, the buckets it gathers before compute
  and those gathers' arguments (:func:`note_first`); the first graph to run after a step is the
  target of the next one;
* a global optimizer step post-hook issues, without a wait, the all-gathers of the target's buckets
  that the optimizer holds a parameter of (so after the last write to those shards that this
  optimizer makes), and records each shard's version counter, both kept on the bucket
  (``DBuffer.prefetched``); a frozen bucket, which no optimizer holds, is issued at the first
  optimizer's step. A second optimizer holding one of them issues that one again if it wrote the
  shard since (Muon for the matrices and AdamW for the rest share a layer's bucket); one whose shard
  is unchanged keeps its gather (a step split by ``step_reduced_first`` steps the bucket in its first
  pass, and the whole step ends after the second). Every rank steps the same optimizers, as in any
  data-parallel loop: the hook issues collectives;
* the next call of that graph takes them (:func:`take`): it runs the graph variant whose
  ``gather_bucket`` for those buckets takes the buffer handed over to it (``fsdp_pass::take_gathered``,
  an op where the gather was, so the graph frees the buffer after its last use; compile/passes/rewrite.py
  :func:`take_prefetched`) instead of gathering. The values are the graph's own: the same cast
  (or FP8 pack) of the same shard, the same collective. Backward gathers those buckets again, as
  without the option (compile/passes/schedule.py :func:`gather_taken_again`), so forward and backward hold
  what they hold without it.

Stale is never read. Any write to a shard after its gather was issued (a user's in-place write to a
parameter, ``load_state_dict``, ``fsdp_pass.unshard(writeback=True)``: every write to a piece bumps
the shard's version, tensor/dispatch.py ``count_writes``) makes the local copy stale. The
decision must be the same on every rank: a rank that gathers again while another does not would
pair the collectives wrongly, and a write on one rank makes every rank's copy of that rank's piece
stale. So :func:`take` first agrees on it: one all-reduce of one integer over the buckets' shard
group (about 0.3 ms on gloo, against the several ms of the gathers it saves). If any rank's shard
changed, every rank drops the prefetched buffers and runs the graph that gathers.

The variant that accumulates without sync ([Note: gradient accumulation without sync]) has a
prefetched twin too: with gradient accumulation the first forward after a step is a ``no_sync``
one, and it names and takes the buckets like the graph that reduces. A graph that gathers one of
the buckets but does not take it (a graph that gathers it later, or a call that finds the gather
stale) drops it (a wait, no collective: the collective was issued on every rank). The buffers
(``m·S`` elements each, in ``param_dtype``) are held from the end of the step to the next forward,
which starts by gathering them anyway.

The ``prefetch`` + 1 gathers issued here are in flight together, from the step to the next forward,
so they go through the ``Work`` API, holding their input and output until the wait: two functional
all-gathers in flight at once corrupt gloo's heap, two through the ``Work`` API did not ([Note: one
collective in flight on gloo] in compile/passes/schedule.py). For the same reason, on CPU a reduce-scatter
still in flight (``overlap_last_reduce``, when an optimizer that does not hold its bucket steps
first) is finished before they are issued.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import record_function

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..tensor.in_flight import settle_before_collective
from ..buckets.gather import GatherConfig, gather_input, unpack_gathered
from ..buckets.node_collectives import finish_gather_within_node

__all__ = ["Target", "discard", "enable", "in_flight", "note_first", "take"]

WAIT_SCOPE = "fsdp_pass::prefetched_gather_wait"  # profiler scope of take's agreement and wait


class _Prefetch(NamedTuple):
    """A bucket's all-gather issued at a step (``DBuffer.prefetched``)."""

    config: GatherConfig  # the gather's arguments in the graph that named it
    version: int  # the shard's version counter when the gather was issued
    work: dist.Work  # the all-gather in flight ([Note: one collective in flight on gloo])
    sent: torch.Tensor  # its input (gather_input of the shard), held until the wait
    received: torch.Tensor  # its output (m times the input; N times in two levels), held until the wait


class Target(NamedTuple):
    """One bucket a graph gathers before its compute, with that gather's arguments in the graph."""

    buffer: object  # the DBuffer
    config: GatherConfig


_target: list[tuple[weakref.ref, GatherConfig]] = []  # the first graph's buckets since the last step
_named_since_step = False  # whether a graph named the target since the last optimizer step
# The live buckets whose ``prefetched`` holds a gather in flight: one truth test when none is.
_holding: "weakref.WeakSet[object]" = weakref.WeakSet()
_hook = None  # the optimizer post-hook's handle, registered by the first graph with the option


def enable() -> None:
    """Register the optimizer step post-hook (once per process)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_after_step)


def in_flight() -> bool:
    """Whether a gather issued at a step is in flight."""
    return bool(_holding)


def note_first(targets: list[Target]) -> None:
    """A graph with the option runs; ``targets`` are the buckets it gathers before compute."""
    global _target, _named_since_step
    if not _named_since_step:
        _target = [(weakref.ref(t.buffer), t.config) for t in targets]
        _named_since_step = True


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    global _named_since_step
    _named_since_step = False
    if not _target:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for ref, config in _target:
        buf = ref()
        if buf is None:
            continue
        if buf.shard.requires_grad and not any(id(p) in held for p in buf.params.values()):
            continue
        entry = buf.prefetched
        if entry is not None and entry.version == buf.shard._version and entry.config == config:
            continue  # issued after the last write to its shard: still good (a frozen bucket, a split step)
        _discard(buf)
        settle_before_collective(buf.shard.device)
        with torch.no_grad():
            sent = gather_input(buf.shard.detach(), config)
        # in two levels only the across-node step is in flight; the within-node step runs where it is taken
        # ([Note: collectives in two levels across nodes])
        world = config.levels.nodes if config.levels is not None else config.shard_world
        received = sent.new_empty(sent.numel() * world)
        work = dist.all_gather_into_tensor(received, sent, group=_resolve_process_group(config.gather_group),
                                           async_op=True)
        buf.prefetched = _Prefetch(config, buf.shard._version, work, sent, received)
        _holding.add(buf)


def _take_off(buf) -> _Prefetch | None:
    """The gather in flight for ``buf``, if any, no longer held by it."""
    entry, buf.prefetched = buf.prefetched, None
    _holding.discard(buf)
    return entry


def _discard(buf) -> None:
    """Drop the gather in flight for a bucket, if any (wait for it: its collective was issued on every rank)."""
    entry = _take_off(buf)
    if entry is not None:
        entry.work.wait()


def discard(buffers) -> None:
    """Drop the gathers in flight for any of ``buffers`` (nothing to look at when none is in flight)."""
    if not _holding:
        return
    for buf in buffers:
        _discard(buf)


def take(targets: list[Target]) -> list[torch.Tensor] | None:
    """The gathered buffers of ``targets`` if a gather is in flight for each, with its config, and no
    rank's shard changed since; else None (and what was in flight for them is dropped). Every rank of
    their shard group must call it at the same point (it agrees with them: one small all-reduce)."""
    entries = [t.buffer.prefetched for t in targets]
    if not any(entries):
        return None
    if not all(e is not None and e.config == t.config for e, t in zip(entries, targets)):
        discard([t.buffer for t in targets])
        return None
    for t in targets:
        _take_off(t.buffer)
    with record_function(WAIT_SCOPE):
        changed = any(t.buffer.shard._version != e.version for e, t in zip(entries, targets))
        stale = torch.tensor([int(changed)], dtype=torch.int32, device=targets[0].buffer.shard.device)
        dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=_resolve_process_group(targets[0].config.shard_group))
        for entry in entries:
            entry.work.wait()
        if stale.item():
            return None
        return [unpack_gathered(_in_rank_order(e.received, t.config), t.buffer.shard.numel(), t.config)
                for e, t in zip(entries, targets)]


def _in_rank_order(received: torch.Tensor, config: GatherConfig) -> torch.Tensor:
    """The issued gather's output as the whole bucket: as is, or after the within-node step."""
    return received if config.levels is None else finish_gather_within_node(received, config.levels)
