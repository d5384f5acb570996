"""Per-bucket settings a user may set on a module before its parameters are sharded.

[Note: settings recorded before sharding]
The backend shards lazily, at the first compiled call, but users (and frameworks) set gradient
sync and the gradient divide factor on the module right after ``torch.compile``: the first
micro-batch of an accumulation loop runs inside ``no_sync(model)``, torchtitan calls
``set_gradient_divide_factor`` while it parallelizes. Settings made while a parameter is not
sharded yet are recorded against the parameter object (weakly, by identity), and the DBuffer that
adopts it takes them over (:func:`apply_recorded`); once sharded, the settings live on the DBuffers.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["apply_recorded", "record", "recorded"]

_recorded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter → {setting: value}


def record(params: Iterable[torch.Tensor], **setting: Any) -> None:
    """Remember a setting (a keyword of :meth:`DBuffer.apply_settings`) for parameters not sharded yet."""
    for p in params:
        _recorded.setdefault(p, {}).update(setting)


def recorded(p: torch.Tensor, setting: str, default: Any = None) -> Any:
    return _recorded.get(p, {}).get(setting, default)


def apply_recorded(buf, params: Iterable[torch.Tensor]) -> None:
    """Give a new DBuffer the settings recorded on its parameters (the last one recorded wins)."""
    for p in params:
        entry = _recorded.get(p)
        if entry is not None:
            del _recorded[p]
            buf.apply_settings(**entry)
