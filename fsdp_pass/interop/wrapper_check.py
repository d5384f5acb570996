"""Refuse the data-parallel wrappers and stale meshes that would fight a sharded model.

[Note: wrappers around a sharded model]
fsdp_pass already synchronizes gradients (one reduce-scatter per bucket). Frameworks wrap every
multi-process model in ``DistributedDataParallel`` unless told otherwise (accelerate's ``prepare``,
Hugging Face ``Trainer``); DDP (or FSDP1) around RaggedShard parameters fails deep inside its
parameter broadcast with a message about tensor aliasing or views. Their constructors are
wrapped, once the first parameters are sharded, to refuse a module holding sharded parameters
with a message that names the fix. FSDP2's ``fully_shard`` is a function users import by name, so
its per-parameter check (``_verify_managed_param``, looked up at call time) is wrapped instead:
FSDP2 would otherwise gather each sharded parameter whole and shard it again as its own DTensor,
leaving fsdp_pass's buckets behind.

A model sharded before the process group exists (``fully_shard`` before ``Accelerator()`` or
``TrainingArguments`` create it) was sharded over a world of one: run on several ranks, every
rank would train its own copy without any gradient sync. ``check_mesh_is_current`` (buckets/mesh.py) refuses
that at the first compiled or eager use.
"""

from __future__ import annotations

import functools

import torch.nn as nn

__all__ = ["install_wrapper_check"]

_installed = False


def install_wrapper_check() -> None:
    """Wrap DDP's and FSDP1's constructors and FSDP2's parameter check to refuse sharded modules (once)."""
    global _installed
    if _installed:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for wrapper in (DistributedDataParallel, FullyShardedDataParallel):
        wrapper.__init__ = _refusing_sharded_modules(wrapper.__init__, wrapper.__name__)
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    if hasattr(_fsdp_init, "_verify_managed_param"):
        _fsdp_init._verify_managed_param = _refusing_sharded_parameters(_fsdp_init._verify_managed_param)
    _installed = True


def _refusing_sharded_modules(init, wrapper_name: str):
    @functools.wraps(init)
    def checked_init(self, module: nn.Module, *args, **kwargs):
        from ..tensor.ragged_tensor import bucket_of, is_sharded

        sharded = next((p for p in module.parameters() if is_sharded(p)), None)
        if sharded is not None:
            raise ValueError(
                f"{wrapper_name} was asked to wrap {type(module).__name__}, whose parameters fsdp_pass has sharded "
                f"(e.g. {bucket_of(sharded)[1]!r}); fsdp_pass already synchronizes gradients: do not wrap the model "
                f"in DistributedDataParallel or FSDP. Frameworks that wrap by themselves have a recipe in "
                f"docs/integrations.md (Hugging Face Trainer / accelerate, Lightning, torchtitan)"
            )
        init(self, module, *args, **kwargs)

    return checked_init


def _refusing_sharded_parameters(verify):
    @functools.wraps(verify)
    def checked_verify(name: str, param, *args, **kwargs):
        from ..tensor.ragged_tensor import bucket_of, is_sharded

        if is_sharded(param):
            raise ValueError(
                f"FSDP2's fully_shard was asked to manage parameter {bucket_of(param)[1]!r} (shape "
                f"{tuple(param.shape)}), which fsdp_pass has sharded; fsdp_pass already shards the parameters and "
                f"synchronizes gradients: do not also call torch.distributed.fsdp.fully_shard on the model (use "
                f"fsdp_pass.fully_shard or torch.compile(model, backend='vescale') alone; frameworks that apply "
                f"FSDP2 by themselves have a recipe in docs/integrations.md)"
            )
        return verify(name, param, *args, **kwargs)

    return checked_verify
