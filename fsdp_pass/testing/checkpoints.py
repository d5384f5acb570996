"""Whole-state snapshots and DCP round trips, for checkpoint tests that compare every tensor."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..interop.state_dict import whole_tensor

__all__ = ["load_and_compare", "whole_state"]


def whole_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam(W) state as a whole tensor, by FQN (a collective on sharded models)."""
    whole = lambda t: whole_tensor(t) if hasattr(t, "full_tensor") else t.detach().clone()  # noqa: E731
    names = {p: n for n, p in model.named_parameters()}
    out = {n: whole(p) for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{names[p]}.{key}"] = whole(state[key])
    return out


def load_and_compare(model: nn.Module, opt: torch.optim.Optimizer, path: str, label: str) -> None:
    """Load the DCP checkpoint at ``path`` into ``model`` and ``opt``, then compare every tensor with
    the whole state saved beside it (``path/full.pt``, from :func:`whole_state`) bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    for p in model.parameters():  # a step on zero gradients creates the states the checkpoint fills in
        p.grad = torch.zeros_like(p)
    opt.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    saved = torch.load(f"{path}/full.pt")
    loaded = whole_state(model, opt)
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), f"{name} differs after loading at {label}"
