"""Gradient shards still being written by a reduce-scatter left in flight: the wait before a read.

The step boundary leaves a bucket's last reduce-scatter in flight into the optimizer step ([Note: the
last reduce-scatter overlaps the optimizer step] in step/deferred_reduce.py). Whatever reads such a
gradient (a RaggedShard op, a method that hands out a piece, a bucket's gradient methods, another
collective on CPU) settles it first through this module. The registry is process-wide, like the
transfers themselves: one entry per output storage, whichever bucket it belongs to.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["any_in_flight", "is_in_flight", "settle_all", "settle_before_collective", "settle_read", "settle_tensor",
           "track"]

_c10d = torch.ops._c10d_functional


class _InFlight(NamedTuple):
    reduced: torch.Tensor  # the reduce-scatter's output (S elements): the gradient shard, before the division
    unreduced: torch.Tensor  # its input (m·S), kept alive until the wait: the transfer reads it
    divisor: float  # GatherConfig.grad_divisor


_in_flight: dict[int, _InFlight] = {}  # the output's storage address → the reduce-scatter writing it


def any_in_flight() -> bool:
    return bool(_in_flight)


def track(reduced: torch.Tensor, unreduced: torch.Tensor, divisor: float) -> None:
    """Remember the in-flight reduce-scatter writing ``reduced`` from ``unreduced``; settling waits for it
    and divides ``reduced`` by ``divisor`` in place."""
    _in_flight[reduced.untyped_storage().data_ptr()] = _InFlight(reduced, unreduced, divisor)


def _address(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage starts; None for a traced tensor (no storage)."""
    if isinstance(t, FakeTensor) or t.is_meta:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _settle(address: int | None) -> None:
    entry = _in_flight.pop(address, None)
    if entry is not None:
        with torch.no_grad():
            _c10d.wait_tensor(entry.reduced)
            entry.reduced.div_(entry.divisor)


def settle_read(pieces: Iterable[torch.Tensor]) -> None:
    """Wait for every in-flight gradient that one of ``pieces`` (RaggedShard local pieces) views."""
    for piece in pieces:
        address = _address(piece)
        if address in _in_flight:
            _settle(address)
            if not _in_flight:
                return


def is_in_flight(piece: torch.Tensor) -> bool:
    """Whether ``piece`` (a RaggedShard gradient's local piece) views a gradient still being reduced."""
    return bool(_in_flight) and _address(piece) in _in_flight


def settle_tensor(t: torch.Tensor) -> None:
    """Wait for the in-flight gradient ``t`` is (or views), if any."""
    if _in_flight:
        _settle(_address(t))


def settle_all() -> None:
    """Wait for every in-flight gradient."""
    for address in list(_in_flight):
        _settle(address)


def settle_before_collective(device: torch.device) -> None:
    """Before another collective on ``device``'s tensors: on CPU, wait for every in-flight gradient
    first, so that one collective is in flight at a time ([Note: one collective in flight on gloo]
    in compile/passes/schedule.py)."""
    if _in_flight and device.type == "cpu":
        settle_all()
