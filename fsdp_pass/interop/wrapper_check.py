"""Refuse the data-parallel wrappers and stale meshes that would fight a sharded model.

[Note: wrappers around a sharded model]
fsdp_pass already synchronizes gradients (one reduce-scatter per bucket). Frameworks wrap every
multi-process model in ``DistributedDataParallel`` unless told otherwise (accelerate's ``prepare``,
Hugging Face ``Trainer``); DDP (or FSDP1) around RaggedShard parameters fails deep inside its
parameter broadcast with a message about tensor aliasing or views. Their constructors refuse a
module holding sharded parameters with a message that names the fix (:func:`refuse_sharded_module`).
FSDP2's ``fully_shard`` refuses each sharded parameter it is asked to manage
(:func:`refuse_sharded_parameter`): FSDP2 would otherwise gather each sharded parameter whole and
shard it again as its own DTensor, leaving fsdp_pass's buckets behind. None of the three asks the
module or its parameters anything that could refuse in time, so
:mod:`fsdp_pass.interop.torch_patches` installs the checks into them, once a model is sharded, and
says why for each.

A model sharded before the process group exists (``fully_shard`` before ``Accelerator()`` or
``TrainingArguments`` create it) was sharded over a world of one: run on several ranks, every
rank would train its own copy without any gradient sync. ``check_mesh_is_current`` (buckets/mesh.py) refuses
that at the first compiled or eager use.
"""

from __future__ import annotations

import torch.nn as nn

from ..tensor.ragged_tensor import bucket_of, is_sharded

__all__ = ["refuse_sharded_module", "refuse_sharded_parameter"]


def refuse_sharded_module(wrapper_name: str, module: nn.Module) -> None:
    """Raise if ``module`` (handed to DDP or FSDP1's constructor) holds parameters fsdp_pass has sharded."""
    sharded = next((p for p in module.parameters() if is_sharded(p)), None)
    if sharded is not None:
        raise ValueError(
            f"{wrapper_name} was asked to wrap {type(module).__name__}, whose parameters fsdp_pass has sharded "
            f"(e.g. {bucket_of(sharded)[1]!r}); fsdp_pass already synchronizes gradients: do not wrap the model "
            f"in DistributedDataParallel or FSDP. Frameworks that wrap by themselves have a recipe in "
            f"docs/integrations.md (Hugging Face Trainer / accelerate, Lightning, torchtitan)"
        )


def refuse_sharded_parameter(param) -> None:
    """Raise if ``param`` (one FSDP2's ``fully_shard`` would manage) is sharded by fsdp_pass."""
    if is_sharded(param):
        raise ValueError(
            f"FSDP2's fully_shard was asked to manage parameter {bucket_of(param)[1]!r} (shape "
            f"{tuple(param.shape)}), which fsdp_pass has sharded; fsdp_pass already shards the parameters and "
            f"synchronizes gradients: do not also call torch.distributed.fsdp.fully_shard on the model (use "
            f"fsdp_pass.fully_shard or torch.compile(model, backend='vescale') alone; frameworks that apply "
            f"FSDP2 by themselves have a recipe in docs/integrations.md)"
        )
