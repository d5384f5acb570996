"""Flat buffers laid out like a bucket's shard, and list ops that run once per bucket on them.

[Note: one kernel per bucket]
A bucket's parameters are pieces of one flat shard and their gradients pieces of one flat
gradient shard (dbuffer.py); their optimizer states are moved into one flat buffer per state kind
(list_kernels.py). All of these have the shard's layout: the same offsets, padding between the
pieces. This file keeps a registry of such *flat buffers*: the address of every piece in them
maps to its *slot* (which bucket, which of its pieces on this rank).

An elementwise ``_foreach_*`` op or fused optimizer kernel (tensor/dispatch.py) whose list
entries are registered pieces then runs on *runs* instead of entries: entries whose pieces are
neighbouring slots of one bucket (nothing but padding between them) in one flat buffer per list
argument, with equal per-entry scalars (torch's bias corrections, fused kernels' step counts),
become one flat view per list argument, from the first piece's start to the last piece's end.
Entries are independent, so they may be taken in any order: a list in parameter order gives one
run per bucket even where the planner permuted the bucket. Out-of-place results come back as one
flat buffer per run, registered too (so ``denom = sqrt(v)`` and the ops on it coalesce as well),
and are handed back as per-entry views. Entries that fit no run (plain tensors, empty pieces,
lists that are not floating point) run as they are, in the same call.

Exactness. An elementwise op computes each output element from the same element of each operand,
so the pieces' elements are computed as before; the CPU ``_foreach_`` kernels are also bitwise the
same on a longer range (``tests/test_optim.py`` checks AdamW, Adam and SGD against the per-parameter
loop). The fused CPU optimizer kernels are not bitwise slice-invariant even per piece: each
tensor's last ``n % vector width`` elements take a scalar loop that computes in double precision,
so which elements round that way moves with the range (a few elements per run, within an ulp).
Reductions (``_foreach_norm``, ``_foreach_max``, ``_foreach_powsum``) are never coalesced.

Padding. The op also computes on the padding between the pieces of a run. What it writes there
never reaches a parameter: no parameter, gradient or optimizer state views it; the all-gather
carries the shard's padding, but the gathered buffer's padding segments are views of nothing; a
backward gives the padding a zero gradient; norms and checkpoints read pieces. Padding starts at
zero (shards, gradient shards, state buffers are zero-filled) and the torch optimizers keep it
zero: weight decay, moments and momentum of zeros are zeros, and Adam's ``denom = sqrt(v) / c + eps``
is ``eps`` there, so the update ``m / denom`` is ``0 / eps = 0``. With ``eps = 0`` (which makes torch
itself divide 0 by 0 for any element that never had a gradient) or a user's ``_foreach_log`` the
padding may hold inf or NaN: harmless, since nothing reads it. Only floating-point lists are
coalesced, so no op can raise on a padding value (integer division by zero does).

Lifetime. A record holds an alias of the buffer's memory, so while it exists no other tensor can
start at one of its addresses, and a weak reference to the tensor whose lifetime bounds it (the
buffer, or what it is a view of; for results made below dispatch, which record no view base, the
per-entry views): when that is freed the record goes, and the memory with it.

Cost. On CPU a list kernel loops over its entries in C++ at about a microsecond each, so the loop
saved is small: a step stays bound by memory traffic (each list op streams the whole bucket) and by
dispatch's Python work per list entry, which planning runs replaces rather than removes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .ragged_tensor import RaggedShardTensor

__all__ = ["FUSED_OPTIMIZER_OPS", "BucketSlots", "Runs", "is_coalescible", "plan_runs", "register", "slot_of"]


class BucketSlots:
    """One bucket's non-empty pieces on this rank, in shard order: where the slots of its flat buffers are."""

    __slots__ = ("starts", "sizes", "index", "__weakref__")

    def __init__(self, ranges: dict[str, tuple[int, int]]) -> None:
        ordered = sorted((a, b, name) for name, (a, b) in ranges.items() if b > a)
        self.starts = [a for a, _, _ in ordered]  # slot i's first element in the shard
        self.sizes = [b - a for a, b, _ in ordered]  # slot i's element count
        self.index = {name: i for i, (_, _, name) in enumerate(ordered)}  # parameter name → slot (non-empty pieces)


class _Buffer:
    """A registered flat buffer: its element ``j`` is element ``origin + j`` of the bucket's shard layout."""

    __slots__ = ("base", "device_index", "dtype", "slots", "origin", "addresses", "is_state", "views", "_lives", "_alive")

    def __init__(self, tensor: torch.Tensor, slots: BucketSlots, origin: int, inside: list[int], is_state: bool,
                 lives: list[torch.Tensor]) -> None:
        self.base: torch.Tensor | None = tensor.detach()  # an alias: it holds the memory, not ``tensor``
        self.device_index, self.dtype = tensor.get_device(), tensor.dtype  # device index: -1 for the CPU
        self.slots = slots
        self.origin = origin
        size = tensor.element_size()
        self.addresses = {tensor.data_ptr() + (slots.starts[i] - origin) * size: i for i in inside}  # slot by address
        self.is_state = is_state  # an optimizer state buffer (list_kernels.py)
        self.views: dict[tuple[int, int], torch.Tensor] = {}  # (first slot, last slot) → view spanning them
        self._lives = [weakref.ref(t, self._gone) for t in lives]  # the record lasts while one of these does
        self._alive = len(lives)

    def _gone(self, _: weakref.ref) -> None:
        self._alive -= 1
        if self._alive == 0:  # forget the slots, let the memory go
            for address in self.addresses:
                if _slots.get(address, (None,))[0] is self:
                    del _slots[address]
            self.base, self.views, self._lives = None, {}, []

    def owner(self) -> torch.Tensor | None:
        """The tensor registered (or the one it is a view of); None once freed."""
        return self._lives[0]() if self._lives else None

    def span(self, first: int, last: int) -> torch.Tensor:
        """A 1-D view from slot ``first``'s start to slot ``last``'s end, the padding between them included."""
        view = self.views.get((first, last))
        if view is None:
            s = self.slots
            start, end = s.starts[first] - self.origin, s.starts[last] + s.sizes[last] - self.origin
            view = self.views[(first, last)] = self.base[start:end]
        return view


# Address of a registered piece's first element → (its buffer, slot, element count).
_slots: dict[int, tuple[_Buffer, int, int]] = {}


def register(tensor: torch.Tensor, slots: BucketSlots, origin: int = 0, is_state: bool = False,
             lives: list[torch.Tensor] | None = None) -> None:
    """Record the 1-D tensor ``tensor`` as laid out like a bucket's shard, from shard element ``origin`` on.

    Only the slots that lie wholly inside it are recorded, and only floating-point tensors. The
    record lasts while one of ``lives`` does: by default the tensor, or the tensor it is a view of
    (views made below dispatch do not record what they view: pass them). Registering again is a no-op.
    """
    if (type(tensor) is not torch.Tensor or tensor.device.type == "meta" or tensor.dim() != 1
            or not tensor.is_contiguous() or not tensor.is_floating_point()):
        return
    end = origin + tensor.numel()
    inside = [i for i, (a, n) in enumerate(zip(slots.starts, slots.sizes)) if a >= origin and a + n <= end]
    if not inside:
        return
    lives = lives or [tensor if tensor._base is None else tensor._base]
    known = _slots.get(tensor.data_ptr() + (slots.starts[inside[0]] - origin) * tensor.element_size())
    if known is not None and known[0].owner() is lives[0] and known[0].slots is slots and known[0].origin == origin:
        return
    buffer = _Buffer(tensor, slots, origin, inside, is_state, lives)
    for address, i in buffer.addresses.items():
        _slots[address] = (buffer, i, slots.sizes[i])


def slot_of(piece: torch.Tensor) -> tuple[_Buffer, int] | None:
    """The registered buffer and slot that the plain tensor ``piece`` is exactly, or None.

    A registered buffer holds its memory, so no other live tensor can start at one of its addresses.
    """
    if type(piece) is not torch.Tensor:  # fake and functional tensors have no address
        return None
    entry = _slots.get(piece.data_ptr())
    if (entry is None or piece.numel() != entry[2] or piece.dtype is not entry[0].dtype or not piece.is_contiguous()
            or piece.get_device() != entry[0].device_index):
        return None
    return entry[0], entry[1]


def _slots_of(values: list | tuple) -> tuple[list[_Buffer | None], list[int]]:
    """:func:`slot_of` of every RaggedShard entry's piece, as buffers (None: no slot) and slots: the loop
    an optimizer step runs for each list argument of each op, so it is kept short."""
    get, buffers, slots = _slots.get, [], []
    for t in values:
        piece = t.piece if isinstance(t, RaggedShardTensor) else None
        entry = get(piece.data_ptr()) if type(piece) is torch.Tensor else None
        if (entry is not None and piece.numel() == entry[2] and piece.dtype is entry[0].dtype and piece.is_contiguous()
                and piece.get_device() == entry[0].device_index):
            buffers.append(entry[0])
            slots.append(entry[1])
        else:
            buffers.append(None)
            slots.append(-1)
    return buffers, slots


# ---------------------------------------------------------------------------------------------
# List ops on runs
# ---------------------------------------------------------------------------------------------

_ELEMENTWISE = (
    "abs acos add addcdiv addcmul asin atan ceil clamp_max clamp_min clone copy cos cosh div erf erfc exp "
    "expm1 floor frac lerp lgamma log log10 log1p log2 maximum minimum mul neg pow reciprocal round rsqrt "
    "sigmoid sign sin sinh sqrt sub tan tanh trunc zero"
).split()
# The fused optimizer kernels RaggedShard dispatch runs per list entry (and coalesces).
FUSED_OPTIMIZER_OPS = frozenset({"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_"})
_COALESCIBLE = frozenset([f"aten::_foreach_{op}{inplace}" for op in _ELEMENTWISE for inplace in ("", "_")]) \
    | FUSED_OPTIMIZER_OPS


def is_coalescible(func) -> bool:
    """Whether ``func`` is an elementwise list op (``_foreach_*`` or fused optimizer kernel) that runs on runs."""
    return func._schema.name in _COALESCIBLE


_TENSORS, _NUMBERS, _ENTRY_VALUES, _SHARED = range(4)  # how an argument varies over the list entries
_argument_kinds: dict[Any, list[tuple[str, int]]] = {}  # op → (argument name, kind), in schema order


def _kinds(func) -> list[tuple[str, int]]:
    kinds = _argument_kinds.get(func)
    if kinds is None:
        kinds = []
        for arg in func._schema.arguments:
            if isinstance(arg.type, torch.ListType):
                numbers = isinstance(arg.type.getElementType(), torch.NumberType)
                kinds.append((arg.name, _NUMBERS if numbers else _TENSORS))
            elif arg.name == "scalars":  # addcdiv/addcmul ".Tensor": one value per entry, in a 1-D tensor
                kinds.append((arg.name, _ENTRY_VALUES))
            else:
                kinds.append((arg.name, _SHARED))
        _argument_kinds[func] = kinds
    return kinds


_Run = list  # of (slot, entry) pairs, by slot; a one-pair run is an entry that runs as it is


class Runs:
    """An elementwise list op planned on runs (:func:`plan_runs`); :meth:`run` calls it once."""

    __slots__ = ("func", "bound", "entries", "ragged", "runs", "buffers", "joined")

    def __init__(self, func, bound: dict[str, Any], entries: int, ragged: list[str], runs: list[_Run],
                 buffers: dict[int, tuple[_Buffer, ...]]) -> None:
        self.func, self.bound, self.entries = func, bound, entries
        self.ragged = ragged  # names of the list arguments of RaggedShard tensors
        self.runs = runs
        self.buffers = buffers  # a run's first entry → its buffer in each argument of ``ragged``
        # Entries that run inside a longer run: every list argument holds the same slot of one bucket there.
        self.joined = {entry for run in runs if len(run) > 1 for _, entry in run}

    def tensor(self, entry: int) -> RaggedShardTensor:
        """A joined entry's first RaggedShard argument: its layout is every argument's there."""
        return self.bound[self.ragged[0]][entry]

    def run(self) -> list[torch.Tensor] | None:
        """Call the op with one entry per run; return its per-entry results (plain tensors), None if in place."""
        if not self.runs:
            return None  # every entry was an empty piece of an in-place op
        arguments = {}
        for name, kind in _kinds(self.func):
            value = self.bound.get(name)
            if kind in (_TENSORS, _NUMBERS) and isinstance(value, (list, tuple)) and len(value) == self.entries:
                value = [self._entry(name, value, run) for run in self.runs]
            elif kind == _ENTRY_VALUES and isinstance(value, torch.Tensor) and value.dim() == 1:
                value = value[[run[0][1] for run in self.runs]]
            arguments[name] = value
        out = self.func(**arguments)
        if not self.func._schema.returns:
            return None
        results: list[Any] = [None] * self.entries
        for run, flat in zip(self.runs, out):
            if len(run) == 1:
                results[run[0][1]] = flat
                continue
            slots = self.buffers[run[0][1]][0].slots
            pieces = flat.split(_lengths(slots, run))[::2]
            for (_, entry), piece in zip(run, pieces):
                results[entry] = piece
            register(flat, slots, slots.starts[run[0][0]], lives=pieces)  # so ops on the results coalesce too
        return results

    def _entry(self, name: str, values: list | tuple, run: _Run) -> Any:
        first = values[run[0][1]]
        if not isinstance(first, RaggedShardTensor):
            return first
        if len(run) == 1:
            return first.piece
        return self.buffers[run[0][1]][self.ragged.index(name)].span(run[0][0], run[-1][0])


def _lengths(slots: BucketSlots, run: _Run) -> list[int]:
    """Piece and padding lengths along a run: piece, gap, piece, ..., piece."""
    lengths = []
    for (i, _), (j, _) in zip(run, run[1:]):
        lengths += [slots.sizes[i], slots.starts[j] - slots.starts[i] - slots.sizes[i]]
    return lengths + [slots.sizes[run[-1][0]]]


def plan_runs(func, bound: dict[str, Any]) -> Runs | None:
    """Plan the elementwise list op ``func(**bound)`` (:func:`is_coalescible`) on runs; None where no two
    entries join."""
    entries = None
    ragged: list[str] = []  # list arguments of RaggedShard tensors
    per_entry: list[list] = []  # what else varies per entry: numbers, plain tensors' values
    for name, kind in _kinds(func):
        value = bound.get(name)
        if kind == _ENTRY_VALUES and isinstance(value, torch.Tensor) and value.dim() == 1:
            if value.device.type != "cpu":
                return None
            per_entry.append(value.tolist())
        elif kind in (_TENSORS, _NUMBERS) and isinstance(value, (list, tuple)) and value:
            entries = len(value) if entries is None else entries
            if len(value) != entries:
                return None
            if isinstance(value[0], RaggedShardTensor):
                ragged.append(name)
            else:
                per_entry.append([_entry_value(v) for v in value])
        elif isinstance(value, RaggedShardTensor):
            return None
    if not ragged:
        return None
    (buffers, slots), *others = [_slots_of(bound[name]) for name in ragged]
    for other_buffers, other_slots in others:  # every list argument must hold the same slot of one bucket
        for k, (b, i) in enumerate(zip(other_buffers, other_slots)):
            if buffers[k] is not None and (b is None or i != slots[k] or b.slots is not buffers[k].slots):
                buffers[k] = None
    in_place = not func._schema.returns
    groups: dict[tuple, _Run] = {}  # same buffer in each list argument, same per-entry values → candidates
    singles: list[_Run] = []
    dropped = False
    for k, key in enumerate(zip(buffers, *(b for b, _ in others), *per_entry)):
        if key[0] is None:
            if in_place and all(_is_empty_piece(bound[name][k]) for name in ragged):
                dropped = True  # an empty piece (the parameter lies on other ranks): nothing to write
            else:
                singles.append([(0, k)])
        else:
            groups.setdefault(key, []).append((slots[k], k))
    runs: list[_Run] = []
    run_buffers: dict[int, tuple[_Buffer, ...]] = {}  # a run's first entry → its buffer in each list argument
    for key, members in groups.items():
        members.sort()
        in_lists = key[:len(ragged)]
        runs.append([members[0]])
        run_buffers[members[0][1]] = in_lists
        for member in members[1:]:
            if member[0] == runs[-1][-1][0] + 1:
                runs[-1].append(member)
            else:
                runs.append([member])
                run_buffers[member[1]] = in_lists
    if not dropped and all(len(run) == 1 for run in runs):
        return None
    return Runs(func, bound, entries, ragged, runs + singles, run_buffers)


def _is_empty_piece(t: Any) -> bool:
    return isinstance(t, RaggedShardTensor) and not t.piece.numel()


def _entry_value(t: Any) -> Any:
    """A per-entry operand that is not RaggedShard (a number, a fused kernel's step count) as runs compare it:
    a CPU tensor by its value, a tensor elsewhere by identity (reading it would wait for the device)."""
    if isinstance(t, torch.Tensor):
        return t.item() if t.device.type == "cpu" and t.numel() == 1 else id(t)
    return t
