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

Buffers and plain parameters go through torch's own ``_apply``. The method is the sharded
modules' own: when parameters are sharded, every module that holds one, and every module above it up
to the module sharded (``fully_shard``'s argument, the module the compiled frame reached them
through), gets an ``_apply`` instance attribute, found before its class's method
(:func:`keep_shards_on_apply`). The outermost of them checks its whole tree before anything moves, so
a refused call changes nothing; torch's ``_apply`` reaches them below a plain parent (an
``OptimizedModule``, a framework's container) through ``child._apply``. Other modules keep torch's
method. A module class's own ``_apply`` override runs inside, with the sharded parameters set aside.

Why not FSDP2's class swap (a subclass per module class; ``fully_shard`` makes one, before any
compile, for FSDP2's methods: [Note: FSDP2's module class on a fully_shard-ed module], but its
``_apply`` is torch's, which this attribute comes before): the backend shards while Dynamo traces,
and Dynamo's guards, built after the backend returns, name class attributes by their place in the
traced class's MRO (``type(m).__mro__[1].__dict__['_compiled_call_impl']``, Hugging Face's
``loss_function`` property): a class swapped in between breaks them, and one swapped after the
compile costs a recompile of every frame. The attribute leaves the class, ``type(model)`` and its
name alone, and copies with the module (``copy.deepcopy``, pickle: it names its module, which the
copy maps to the copied one).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..tensor.ragged_tensor import bucket_of, is_sharded

__all__ = ["keep_shards_on_apply"]


class _ApplyKeepingShards:
    """A sharded module's ``_apply``: leaves its sharded parameters in their buckets."""

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)  # the module holds this: no reference cycle

    def __call__(self, fn, recurse: bool = True):
        global _checking
        module = self._module()
        if _checking is fn:  # an outer sharded module checked this tree already
            return _apply_keeping_shards(module, fn, recurse)
        for sub in module.modules() if recurse else (module,):  # check first: a refused call changes nothing
            for key, p in sub._parameters.items():
                if p is not None and is_sharded(p):
                    _check_kept(sub, key, p, fn)
        outer, _checking = _checking, fn
        try:
            return _apply_keeping_shards(module, fn, recurse)
        finally:
            _checking = outer

    def __reduce__(self):
        return _ApplyKeepingShards, (self._module(),)


_checking = None  # the fn of the outermost sharded module's _apply in progress: its tree was checked on entry


def keep_shards_on_apply(root: nn.Module) -> None:
    """Give each module of ``root`` holding sharded parameters, or above one, its own ``_apply`` (once)."""
    memo: dict[int, bool] = {}
    for module in root.modules():
        if not isinstance(vars(module).get("_apply"), _ApplyKeepingShards) and _holds_shards(module, memo):
            vars(module)["_apply"] = _ApplyKeepingShards(module)


def _holds_shards(module: nn.Module, memo: dict[int, bool]) -> bool:
    key = id(module)
    if key not in memo:
        memo[key] = False  # a module reached again inside its own subtree adds nothing
        memo[key] = (any(p is not None and is_sharded(p) for p in module._parameters.values())
                     or any([_holds_shards(child, memo) for child in module.children()]))
    return memo[key]


def _apply_keeping_shards(self: nn.Module, fn, recurse: bool):
    sharded = {key: p for key, p in self._parameters.items() if p is not None and is_sharded(p)}
    apply = type(self)._apply  # the class's own, torch's unless it overrides it
    if not sharded:
        return apply(self, fn, recurse)
    order = list(self._parameters)
    for key in sharded:  # torch's _apply sees only the rest; the sharded ones stay untouched
        del self._parameters[key]
    try:
        apply(self, fn, recurse)
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
