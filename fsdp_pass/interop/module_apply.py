"""``Module._apply`` (``.to()``, ``.cpu()``, ``.float()``, ``.half()``, ``.to_empty()``) on sharded modules.

[Note: Module._apply on sharded parameters]
Frameworks call ``model.to(device)`` on a model the user has already sharded (Hugging Face
``Trainer``, accelerate's ``prepare``, Lightning's strategies), and FSDP2's meta-device flow calls
``model.to_empty(device=...)``. For a tensor subclass, ``nn.Module._apply`` replaces the parameter's
contents through ``torch.utils.swap_tensors`` with ``fn(param)`` wrapped in a new ``nn.Parameter``:
the object survives, but its attributes (the DBuffer that owns it), its tensor hooks (the eager
gradient hook) and, for ``to_empty``, its piece (a fresh ``empty_like``, no longer a view of the
bucket) do not. The parameter would silently stop being the bucket's.

Like FSDP2's ``FSDPModule._apply``, sharded parameters are handled by the sharding itself: each
sharded parameter of the module is passed through ``fn`` only to learn what the call asks for, and
then

* kept as it is when ``fn`` keeps its device and dtype (``.to(same device)``, ``.cpu()`` on CPU,
  ``.float()`` on fp32, ``.to_empty(device=its device)``: the shard already holds real memory, and
  ``to_empty`` promises nothing about values);
* refused, naming the parameter and the fix, when ``fn`` changes its dtype (``mp_policy`` casts
  for compute, the master shard keeps its dtype) or its device (build or move the model before
  sharding; on the meta device the shards are already allocated on the mesh's device).

Buffers and plain parameters go through torch's own ``_apply``. The hook is installed on
``nn.Module`` once, when the first parameters are sharded; modules without sharded parameters take
torch's path unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..tensor.ragged_tensor import bucket_of, is_sharded

__all__ = ["install_module_apply"]

_torch_apply = nn.Module._apply


def install_module_apply() -> None:
    """Route ``nn.Module._apply`` through :func:`_apply_keeping_shards` (once per process)."""
    if nn.Module._apply is not _apply_keeping_shards:
        nn.Module._apply = _apply_keeping_shards


_checking = None  # the fn of the outermost _apply in progress: its whole tree was checked on entry


def _apply_keeping_shards(self: nn.Module, fn, recurse: bool = True):
    global _checking
    if _checking is not fn:  # check every sharded parameter first: a refused call changes nothing
        for module in self.modules() if recurse else (self,):
            for key, p in module._parameters.items():
                if p is not None and is_sharded(p):
                    _check_kept(module, key, p, fn)
        outer, _checking = _checking, fn
        try:
            return _apply_keeping_shards(self, fn, recurse)
        finally:
            _checking = outer
    sharded = {key: p for key, p in self._parameters.items() if p is not None and is_sharded(p)}
    if not sharded:
        return _torch_apply(self, fn, recurse)
    order = list(self._parameters)
    for key in sharded:  # torch's _apply sees only the rest; the sharded ones stay untouched
        del self._parameters[key]
    try:
        _torch_apply(self, fn, recurse)
    finally:
        rest = dict(self._parameters)
        self._parameters.clear()
        self._parameters.update((key, sharded[key] if key in sharded else rest[key]) for key in order)
    return self


def _check_kept(module: nn.Module, key: str, p: torch.Tensor, fn) -> None:
    """Raise unless ``fn`` (what ``_apply`` would do to ``p``) keeps ``p``'s device and dtype."""
    with torch.no_grad():
        applied = fn(p)
    _, name = bucket_of(p)
    if applied.dtype != p.dtype:
        raise TypeError(
            f"{type(module).__name__}.{key} (parameter {name!r}, shape {tuple(p.shape)}) is sharded in {p.dtype}; "
            f"changing a sharded model's dtype ({p.dtype} -> {applied.dtype}, e.g. .half() or .to(torch.bfloat16)) "
            f"would detach the parameters from their buckets. Keep the master weights in {p.dtype} and compute in "
            f"{applied.dtype} with options={{'mp_policy': {{'param_dtype': {applied.dtype}}}}}, or cast the model "
            f"before sharding"
        )
    if applied.device != p.device:
        raise ValueError(
            f"{type(module).__name__}.{key} (parameter {name!r}, shape {tuple(p.shape)}) is sharded on {p.device}; "
            f"moving a sharded model to {applied.device} is not supported. Move the model before sharding "
            f"(model.to({str(applied.device)!r}) first), or build it on the meta device: its shards are then "
            f"allocated on the mesh's device"
        )
