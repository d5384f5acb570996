"""Hugging Face ``accelerate``: :func:`prepare` instead of ``accelerator.prepare`` for a model fsdp_pass shards.

``accelerator.prepare`` wraps every multi-process model in ``DistributedDataParallel``, which
fsdp_pass refuses ([Note: wrappers around a sharded model]): fsdp_pass already reduces gradients.
:func:`prepare` registers the model through accelerate's own ``prepare_model(...,
evaluation_mode=True)`` (mixed precision and device placement, no DDP), prepares everything else as
``accelerator.prepare`` does, and makes the model fit accelerate's other calls:

* ``accelerator.accumulate(model)`` / ``accelerator.no_sync(model)`` look up ``model.no_sync``: it is
  :func:`fsdp_pass.no_sync`, so micro-batches but the last reduce-scatter nothing;
* ``accelerator.save_model``, ``save_state`` and ``load_state`` save with ``torch.save`` /
  ``safetensors`` on the main process: the model's and optimizers' state dicts are set to whole
  tensors (:func:`fsdp_pass.set_state_dict_type`), which every rank gathers, and whole states
  load back into the pieces;
* ``accelerator.clip_grad_norm_`` runs torch's ``clip_grad_norm_``, which takes the global norm
  over the pieces.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule

from ..gradient_sync import no_sync
from ..state_dict import set_state_dict_type

__all__ = ["prepare"]


def prepare(accelerator: Any, model: nn.Module, *objects: Any) -> tuple:
    """``accelerator.prepare(model, *objects)`` for a model compiled with ``model.compile(backend="vescale")``.

    Returns the prepared model followed by the prepared ``objects`` (optimizers, data loaders,
    schedulers), in order. Call it on every rank, after ``Accelerator()`` created the process group.
    """
    if isinstance(model, OptimizedModule):
        raise ValueError(
            "fsdp_pass.integrations.accelerate.prepare: pass the model compiled in place "
            "(model.compile(backend='vescale')), not torch.compile's wrapper: saving through the wrapper writes "
            "'_orig_mod.'-prefixed keys that from_pretrained ignores"
        )
    if accelerator.num_processes > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fsdp_pass.integrations.accelerate.prepare: accelerate runs several processes but no process group "
            "exists; create the Accelerator before preparing the model"
        )
    model.no_sync = functools.partial(no_sync, model)  # what accelerator.no_sync / accumulate call
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    set_state_dict_type(model, "full", optimizers=optimizers)
    prepared = accelerator.prepare_model(model, evaluation_mode=True)  # no DDP: fsdp_pass reduces gradients
    if not objects:
        return (prepared,)
    rest = accelerator.prepare(*objects)
    return (prepared, *(rest if isinstance(rest, tuple) else (rest,)))
