"""Lightning: :class:`ModelParallelStrategy`, Lightning's own strategy, also loading fsdp_pass checkpoints.

Lightning's ``ModelParallelStrategy`` trains a model that ``configure_model`` shards with fsdp_pass
as it is (``.to()``, torch's state-dict API, ``clip_grad_norm_``, DCP saves all work on RaggedShard
parameters), but its checkpoint loading looks for a module with DTensor parameters and refuses the
model otherwise. This subclass loads the same two checkpoint kinds Lightning saves, through the same
torch APIs: a distributed (DCP) checkpoint directory, or one full file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """``lightning.pytorch.strategies.ModelParallelStrategy`` for models sharded by fsdp_pass in ``configure_model``.

    Takes the same arguments. ``trainer.fit(..., ckpt_path=...)`` resumes from either checkpoint kind.
    """

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
