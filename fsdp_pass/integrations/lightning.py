"""Lightning: :class:`ModelParallelStrategy`, Lightning's own strategy, also loading fsdp_pass checkpoints.

Lightning's ``ModelParallelStrategy`` trains a model that ``configure_model`` shards with fsdp_pass
as it is (``.to()``, torch's state-dict API, ``clip_grad_norm_``, DCP saves all work on RaggedShard
parameters), but its checkpoint loading looks for a module with DTensor parameters and refuses the
model otherwise. This subclass loads the same two checkpoint kinds Lightning saves, through the same
torch APIs: a distributed (DCP) checkpoint directory, or one full file. With ``accumulate_grad_batches``,
it runs the micro-batches before the last of each step under ``fsdp_pass.no_sync`` (Lightning's
``block_backward_sync``, which only knows DDP), so each step reduce-scatters once per bucket.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ..buckets.gradient_sync import no_sync

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """``lightning.pytorch.strategies.ModelParallelStrategy`` for models sharded by fsdp_pass in ``configure_model``.

    Takes the same arguments. ``trainer.fit(..., ckpt_path=...)`` resumes from either checkpoint kind;
    ``accumulate_grad_batches`` reduce-scatters gradients once per optimizer step, not per micro-batch.
    """

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's training loop runs each micro-batch but the last of a step (forward and backward) in here.

        Under ``fsdp_pass.no_sync`` each rank keeps summing its unreduced gradient per bucket; the last
        micro-batch's backward, outside, reduce-scatters that sum with its own once per bucket.
        """
        model = self.model
        if model is None or next(model.parameters(), None) is None:
            yield
            return
        with no_sync(model):
            yield

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        model, strict = self.model, self.lightning_module.strict_loading
        # torch's get_optimizer_state_dict makes the states to load into only when no parameter holds a
        # gradient; Lightning zeroes gradients before a step, so a module trained before still holds some.
        model.zero_grad(set_to_none=True)
        if path.is_dir():  # save_distributed_checkpoint=True: DCP, any world size
            state = {"state_dict": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
            for i, optimizer in enumerate(self.optimizers):
                key = f"optimizer_{i}"
                state = {key: get_optimizer_state_dict(model, optimizer)}
                dcp.load(state, checkpoint_id=path)
                set_optimizer_state_dict(model, optimizer, optim_state_dict=state[key])
            return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
        # save_distributed_checkpoint=False: one file of whole tensors, optimizer states keyed by parameter index
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        set_model_state_dict(model, checkpoint.pop("state_dict"),
                             options=StateDictOptions(full_state_dict=True, strict=strict))
        for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", [])):
            optimizer.load_state_dict(state)  # whole states: each rank keeps its pieces
        return checkpoint
