"""Hugging Face ``Trainer``: :class:`Trainer`, transformers' own ``Trainer`` for a model fsdp_pass shards.

The recipe (docs/integrations.md, "Hugging Face Trainer")::

    model = AutoModelForCausalLM.from_pretrained(...)              # or from a config
    model.compile(backend="vescale")                                # compile in place
    trainer = fsdp_pass.integrations.transformers.Trainer(model=model, args=TrainingArguments(...), ...)
    trainer.train()                                                 # resume_from_checkpoint=... resumes
    trainer.save_model(out)                                         # every rank; from_pretrained(out) loads it

Same arguments and behaviour as ``transformers.Trainer``. What differs:

* The model is registered with accelerate when the Trainer is built, through accelerate's own
  ``prepare_model(..., evaluation_mode=True)`` as :func:`fsdp_pass.integrations.accelerate.prepare`
  does (no ``DistributedDataParallel``: fsdp_pass reduces gradients, [Note: wrappers around a
  sharded model]); the Trainer's ``accelerator.prepare(model, optimizer)`` then finds it prepared
  and leaves it as it is. Its ``no_sync`` is :func:`fsdp_pass.no_sync`, which the Trainer's
  gradient accumulation looks up (``accelerator.no_sync``): micro-batches but the last of each
  step reduce-scatter nothing.
* ``save_model`` and the Trainer's checkpoints write whole tensors ([Note: the Trainer saves on the
  main process only]); loading needs nothing: ``load_state_dict`` of the model and of the
  optimizer takes whole tensors into the pieces (fsdp_pass's state-dict API).
* Gradient clipping and the logged ``grad_norm`` are the Trainer's own (``accelerator.clip_grad_norm_``,
  torch's ``clip_grad_norm_``, which takes the global norm over the pieces).
* The natural mistakes fail at once, naming the recipe: ``TrainingArguments(torch_compile=True)``
  or ``torch_compile_backend=...`` (accelerate would compile the model a second time and knows no
  ``"vescale"`` backend), ``fsdp`` / ``deepspeed`` arguments, ``torch.compile``'s wrapper, a model
  neither compiled in place nor sharded, and (after the first micro-batch) a model compiled with
  another backend, whose ranks would train apart.

Methods overridden, and why: ``__init__`` (the checks above, before the Trainer builds its
accelerator; then the model is prepared), ``call_model_init`` (models made by ``model_init`` are
prepared the same way), ``training_step`` (the one-time check that the model was sharded), and two
underscore methods the Trainer's saves go through, since the Trainer offers no public hook between
"which rank writes" and "what is written": ``_save`` (the model's weights) and
``_save_optimizer_and_scheduler`` (the optimizer's states).

[Note: the Trainer saves on the main process only]
``save_model`` and ``_save_checkpoint`` run on every rank, but the Trainer reads the state dicts
only where it writes: ``_save`` returns early on the other ranks before ``save_pretrained`` calls
``model.state_dict()``, and ``optimizer.state_dict()`` is ``torch.save``-d under
``args.should_save``. Whole values of sharded tensors are gathered by collectives, which every rank
must enter (on the main process alone they would hang), and a sharded state dict saved as it is
holds one rank's pieces (refused: a RaggedShard tensor does not pickle over several ranks, and
``save_pretrained`` finds no storage). So ``_save`` first gathers the model's state dict on every
rank (:func:`fsdp_pass.get_full_state_dict`; the writing rank keeps it) and hands it to the
Trainer's ``_save``, which passes it to ``save_pretrained(state_dict=...)``; and
``_save_optimizer_and_scheduler`` gathers every optimizer state whole on every rank, in one order,
and the writing rank saves the result where the Trainer's loader looks for it (``optimizer.pt``,
then ``scheduler.pt`` as the Trainer does).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
import transformers
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from ..tensor.ragged_tensor import is_sharded
from ..interop.state_dict import get_full_state_dict, whole_optimizer_state
from .accelerate import _prepare_model, _refuse_compile_wrapper

__all__ = ["Trainer"]

_CALLER = "fsdp_pass.integrations.transformers.Trainer"


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for a model compiled in place with ``model.compile(backend="vescale")``.

    Takes the same arguments. Build it on every rank (as the Trainer always is); the model may also
    be sharded with :func:`fsdp_pass.fully_shard` after ``TrainingArguments`` created the process group.
    """

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None,
                 *more: Any, **kwargs: Any) -> None:
        if model is not None:
            _refuse_compile_wrapper(model, _CALLER)
        if args is not None:
            _check_training_arguments(args)
        self._fsdp_pass_checked = False
        super().__init__(model, args, *more, **kwargs)
        self.model = self.model_wrapped = _prepare_model(self.accelerator, self.model, _CALLER)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        model = super().call_model_init(trial)
        return _prepare_model(self.accelerator, model, _CALLER)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, *args, **kwargs)
        if not self._fsdp_pass_checked:  # the first compiled call has sharded the model, if anything shards it
            self._fsdp_pass_checked = True
            if self.args.world_size > 1 and not any(is_sharded(p) for p in self.model.parameters()):
                raise RuntimeError(
                    f"{_CALLER}: after its first micro-batch no parameter of the model is sharded by fsdp_pass, so on "
                    f"{self.args.world_size} processes nothing synchronizes its gradients; compile the model in place "
                    f"with the vescale backend (model.compile(backend='vescale')) before building the Trainer "
                    f"(docs/integrations.md, Hugging Face Trainer)"
                )
        return loss

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # [Note: the Trainer saves on the main process only]: gather on every rank, then the Trainer's own save.
        if state_dict is None:
            state_dict = get_full_state_dict(self.model, rank0_only=True)  # the writing rank keeps it
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # [Note: the Trainer saves on the main process only]; the Trainer's plain (non-DeepSpeed/FSDP/XLA) branch.
        state = whole_optimizer_state(self.optimizer.state_dict(), keep=self.args.should_save)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def _check_training_arguments(args: transformers.TrainingArguments) -> None:
    if args.torch_compile:
        raise ValueError(
            f"{_CALLER}: TrainingArguments(torch_compile=True, torch_compile_backend={args.torch_compile_backend!r}) "
            f"would have accelerate compile the model a second time, and accelerate knows no 'vescale' backend; "
            f"leave torch_compile, torch_compile_backend and torch_compile_mode unset and compile the model in "
            f"place before building the Trainer: model.compile(backend='vescale') (docs/integrations.md, Hugging "
            f"Face Trainer)"
        )
    for name in ("fsdp", "deepspeed"):
        if getattr(args, name, None):
            raise ValueError(
                f"{_CALLER}: TrainingArguments({name}=...) has accelerate shard or wrap the model, which fsdp_pass "
                f"already shards; leave fsdp and deepspeed unset (docs/integrations.md, Hugging Face Trainer)"
            )
