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

from ..buckets.gradient_sync import no_sync
from ..tensor.ragged_tensor import is_sharded
from ..interop.state_dict import set_state_dict_type

__all__ = ["prepare"]


def prepare(accelerator: Any, model: nn.Module, *objects: Any) -> tuple:
    """``accelerator.prepare(model, *objects)`` for a model compiled with ``model.compile(backend="vescale")``.

    Returns the prepared model followed by the prepared ``objects`` (optimizers, data loaders,
    schedulers), in order. Call it on every rank, after ``Accelerator()`` created the process group.
    """
    prepared = _prepare_model(accelerator, model, "fsdp_pass.integrations.accelerate.prepare")
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    set_state_dict_type(model, "full", optimizers=optimizers)
    if not objects:
        return (prepared,)
    rest = accelerator.prepare(*objects)
    return (prepared, *(rest if isinstance(rest, tuple) else (rest,)))


def _refuse_compile_wrapper(model: nn.Module, caller: str) -> None:
    if isinstance(model, OptimizedModule):
        raise ValueError(
            f"{caller}: pass the model compiled in place (model.compile(backend='vescale')), not torch.compile's "
            f"wrapper: saving through the wrapper writes '_orig_mod.'-prefixed keys that from_pretrained ignores"
        )


def _prepare_model(accelerator: Any, model: nn.Module, caller: str) -> nn.Module:
    """``accelerator.prepare_model`` without DDP, for a model fsdp_pass shards (shared with the Trainer integration).

    Refuses what would train wrong: the compile wrapper, a missing process group, and a model that
    nothing would shard (neither compiled in place nor ``fully_shard``-ed) on several processes.
    Gives the model the ``no_sync`` accelerate looks up. ``caller`` names the recipe in messages.
    """
    _refuse_compile_wrapper(model, caller)
    if accelerator.num_processes > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{caller}: accelerate runs several processes but no process group exists; create the Accelerator "
                f"before preparing the model"
            )
        compiled = getattr(model, "_compiled_call_impl", None) is not None  # what nn.Module.compile sets
        if not compiled and not any(is_sharded(p) for p in model.parameters()):
            raise ValueError(
                f"{caller}: the model is neither compiled in place (model.compile(backend='vescale')) nor sharded "
                f"(fsdp_pass.fully_shard), and it is not wrapped in DDP either: on {accelerator.num_processes} "
                f"processes nothing would synchronize its gradients. Compile it with backend='vescale' before "
                f"preparing it (docs/integrations.md)"
            )
    model.no_sync = functools.partial(no_sync, model)  # what accelerator.no_sync / accumulate call
    return accelerator.prepare_model(model, evaluation_mode=True)  # no DDP: fsdp_pass reduces gradients
