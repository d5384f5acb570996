"""Parameters that were never initialized nor loaded: a NaN placeholder, checked before first use.

[Note: uninitialized shards]
``fully_shard`` of a meta-device model allocates only each rank's shards and fills them with the
model's own init where it finds one. A parameter whose module has none (a norm weight set in
``__init__``, a module without ``reset_parameters``) is left for a checkpoint load. Using it before
that must raise an error that names it, not train on whatever the allocator left there.

What counts as "loaded" has to cover every way a value reaches a piece: ``dcp.load`` (which copies
into plain views of the pieces, below our dispatch), ``set_full_state_dict``, ``p.copy_``/``fill_``
on the parameter, writes into ``p.to_local()`` or into the bucket's shard, user init code. Two
cheaper signals were considered and rejected:

* the shard's version counter: every write to a piece bumps it, but there is one counter per
  bucket (the pieces are views of one shard), so it cannot say *which* parameter was written; and
  a rank whose piece of a parameter is empty sees no write at all, so ranks would disagree;
* marks in the DCP load hooks: they miss every writer that is not DCP.

So the value itself is the record. A parameter left for a checkpoint has its piece filled with
NaN (:func:`mark_pending`) and its name kept in its bucket's *pending* set
(:attr:`DBuffer.uninitialized`). Any write replaces the NaNs; no real checkpoint or init holds a
parameter that is NaN everywhere. Pending names are checked only while some remain anywhere (one
truth test of the set of buckets holding some, per call otherwise):

* eager calls gather the bucket anyway (:meth:`DBuffer.whole_parameter`, buckets/whole_values.py), so
  :func:`check_gathered` looks at the whole values, the same on every rank: no collective;
* a compiled graph checks its buckets before it runs (:func:`check_buckets`): each rank flags the
  pending parameters whose non-empty piece is still all NaN, and a MAX all-reduce over the
  bucket's own ranks (its data-parallel groups) makes every rank reach the same verdict (a rank holding an empty piece cannot
  tell by itself).

A check clears the names found written, on every rank alike (the verdicts are shared), so the
pending sets stay equal across ranks and the flag vectors line up. Once none is left the checks
cost nothing. A parameter whose checkpoint value is NaN everywhere would be reported as never
loaded; such a checkpoint is broken anyway.
"""

from __future__ import annotations

import weakref

import torch

from ..tensor import collectives

__all__ = ["any_pending", "check_buckets", "check_gathered", "check_meta_buffers_before_forward", "mark_initialized",
           "mark_pending"]

# The live buckets whose ``uninitialized`` set is not empty: the backend asks every call whether any is.
_holding: "weakref.WeakSet[object]" = weakref.WeakSet()


def any_pending() -> bool:
    """Whether any live bucket has a parameter that was never initialized nor loaded."""
    return bool(_holding)


@torch.no_grad()
def mark_pending(buf, name: str) -> None:
    """Fill ``name``'s piece with the NaN placeholder and remember it until a check finds it written."""
    buf.local_piece(name).fill_(float("nan"))
    buf.uninitialized.add(name)
    _holding.add(buf)


def mark_initialized(buf, name: str) -> None:
    """Forget ``name`` (fsdp_pass itself just wrote its value on every rank)."""
    buf.uninitialized.discard(name)
    if not buf.uninitialized:
        _holding.discard(buf)


def _still_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool(torch.isnan(t).all())


def check_gathered(buf, views: dict[str, torch.Tensor]) -> None:
    """Eager path: raise if a pending parameter of ``buf`` is all NaN in its gathered whole value."""
    names = buf.uninitialized
    if not names:
        return
    bad = sorted(n for n in names if _still_placeholder(views[n]))
    _settle(buf, names, set(bad))


def check_buckets(buffers) -> None:
    """Compiled path: one MAX all-reduce per bucket with pending parameters, over that bucket's ranks."""
    error = None
    for buf in buffers:
        names = sorted(buf.uninitialized)
        if not names:
            continue
        flags = torch.tensor([_still_placeholder(buf.local_piece(n)) for n in names], dtype=torch.int32,
                             device=buf.shard.device)
        for group in buf.mesh.data_parallel_groups():
            collectives.all_reduce_(flags, group, "max")
        try:
            _settle(buf, buf.uninitialized, {n for n, f in zip(names, flags.tolist()) if f})
        except RuntimeError as e:
            error = error or e
    if error is not None:
        raise error


def _settle(buf, names: set[str], bad: set[str]) -> None:
    for n in list(names):
        if n not in bad:
            mark_initialized(buf, n)
    if bad:
        shown = sorted(bad)
        more = f" and {len(shown) - 8} more" if len(shown) > 8 else ""
        raise RuntimeError(
            f"parameters {shown[:8]}{more} are used before they were initialized or loaded: the model was built "
            f"on the meta device and fully_shard found no init for them (no reset_parameters, Hugging Face "
            f"_init_weights or init_weights() on their module), so they still hold the NaN placeholder; load a "
            f"checkpoint first (dcp.load(model.state_dict(), storage_reader=...) or fsdp_pass.set_full_state_dict), "
            f"or write their values under torch.no_grad() (e.g. param.fill_(1.0)) before the forward"
        )


# [Note: buffers left on the meta device]
# A non-persistent buffer that fully_shard's replayed init cannot compute (torchtitan computes its
# rope cache in ``init_states``), and every buffer under ``init="skip"``, stays on the meta device
# for the FSDP2 flow: ``model.to_empty(device=...)`` allocates it, the model's own init fills it.
# A forward pre-hook on the sharded module names what is still on meta until none is; then it
# removes itself. It runs outside Dynamo, so compiled and eager calls get the same message.


def check_meta_buffers_before_forward(module: torch.nn.Module, left: list[tuple[torch.nn.Module, str]],
                                      names: dict[int, str]) -> None:
    """Register the pre-hook of [Note: buffers left on the meta device] for ``left`` ((module, buffer name) pairs)."""
    handle = None

    @torch._dynamo.disable
    def hook(*_):
        still = [f"{names[id(m)] + '.' if names[id(m)] else ''}{n}" for m, n in left
                 if m._buffers.get(n) is not None and m._buffers[n].is_meta]
        if not still:
            handle.remove()
            return
        raise RuntimeError(
            f"buffers {still[:8]}{' and more' if len(still) > 8 else ''} are still on the meta device: fully_shard "
            f"left them for the model's own init (no reset_parameters() computes them, or init='skip'). Call "
            f"model.to_empty(device=...) and then the model's init (e.g. model.init_weights()) before the forward"
        )

    handle = module.register_forward_pre_hook(hook)
