"""Whole (unsharded) state dicts of a sharded model: export on rank 0, load on every rank.

:func:`get_full_state_dict` / :func:`set_full_state_dict` are the full-state functions for models
sharded by ``fully_shard`` or the ``vescale`` backend, including tensor/expert-parallel DTensor
parameters whose local tensors are RaggedShard ([Note: FSDP over TP/EP] in sharding/materialize.py).
For sharded checkpoints that load at any world size, use DCP (``torch.distributed.checkpoint``).

[Note: torch's state-dict API on sharded models]
``torch.distributed.checkpoint.state_dict`` (what torchtitan's checkpointer, Lightning and
accelerate call) gathers DTensors only: with ``full_state_dict=True`` a RaggedShard parameter and
its optimizer states would come back as this rank's piece, and a framework would save shards as if
whole. Once a model is sharded, the API gives and takes whole tensors:

* ``full_state_dict=True`` of ``get_model_state_dict``, ``get_optimizer_state_dict`` and
  ``get_state_dict``: torch's gather first replaces every sharded tensor by its whole value
  (:func:`whole_tensor`, a collective on every rank), then runs as before (CPU offload, rank-0-only
  results). torch offers no hook there, so this one is a patch (interop/torch_patches.py). TP/EP
  parameters would need none ([Note: DTensors over RaggedShard local tensors]).
* ``optimizer.load_state_dict`` of whole states: a load post-hook on the optimizer (registered the
  first time it steps over a sharded model, or when torch's ``set_optimizer_state_dict`` makes its
  states) keeps this rank's piece of each whole state of a sharded parameter, in the parameter's
  layout, as a state made by a step would be. Loading model values needs nothing:
  ``load_state_dict`` copies whole tensors into the pieces (``copy_``).

An optimizer that has not stepped yet carries no hook, and the backend shards lazily, so a framework
may load whole optimizer states (a resumed run) before either: a global optimizer step pre-hook cuts
the whole states of sharded parameters to their pieces the same way before the step, once per
parameter.

Without ``full_state_dict`` the API returns the sharded, DCP-saveable form unchanged.
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..tensor.ragged_tensor import (RaggedShardTensor, bucket_of, holds_pieces, is_sharded, local_block, over_pieces,
                                     whole_tensor)

__all__ = ["get_full_state_dict", "install_state_dict_api", "set_full_state_dict", "set_state_dict_type",
           "whole_optimizer_state",
           "whole_tensor"]


def get_full_state_dict(model: nn.Module, *, rank0_only: bool = True,
                        cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered whole (plain tensors).

    A collective: call it on every rank of the model's mesh, in the same order. With ``rank0_only``
    only the model's first rank (coordinate 0 on every mesh its parameters use: global rank 0 for a
    mesh over the world, the stage's first rank for a pipeline stage sharded over a sub-mesh) keeps
    the result; the other ranks get ``{}`` (they still take part in the gathers). ``cpu_offload``
    moves the result to the CPU.
    """
    module = getattr(model, "_orig_mod", model)
    keep = not rank0_only or _first_rank_of_model(module)
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        whole = whole_tensor(value) if isinstance(value, (RaggedShardTensor, DTensor)) else value.detach()
        if keep:
            out[name] = whole.cpu() if cpu_offload else whole
    return out


def _first_rank_of_model(module: nn.Module) -> bool:
    """Whether this rank is at coordinate 0 of every mesh the module's sharded parameters use."""
    if not dist.is_initialized():
        return True
    meshes = {}
    for p in module.parameters():
        if isinstance(p, DTensor):
            meshes[id(p.device_mesh)] = p.device_mesh
        if is_sharded(p):
            mesh = bucket_of(p)[0].mesh.mesh
            if mesh is not None:
                meshes[id(mesh)] = mesh
    if not meshes:
        return dist.get_rank() == 0
    return all(all(c == 0 for c in (m.get_coordinate() or [1])) for m in meshes.values())


@torch.no_grad()
def set_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load whole tensors (every rank passes the same ``state``): each rank keeps only its piece.

    No communication. ``strict`` raises on missing or unexpected keys, like ``load_state_dict``.
    """
    module = getattr(model, "_orig_mod", model)
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(
            f"set_full_state_dict: missing keys {missing}, unexpected keys {unexpected}; pass the state dict of the "
            f"same model (get_full_state_dict) or strict=False"
        )
    for name, target in own.items():
        if name not in state:
            continue
        full = state[name]
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(
                f"set_full_state_dict: {name!r} has shape {tuple(full.shape)} but the model's is "
                f"{tuple(target.shape)}; pass whole (unsharded) tensors of the model's shapes"
            )
        if isinstance(target, DTensor):  # tensor/expert parallel: this rank's block, then its RaggedShard piece
            block = local_block(full, target._spec)
            target._local_tensor.copy_(block.to(target.device, target.dtype))
        else:
            target.copy_(full.to(target.device, target.dtype))


_FULL_HOOK = "_fsdp_pass_full_state_dict_hook"  # on a model or optimizer in "full" mode: the hook's handle


def set_state_dict_type(model: nn.Module, state_dict_type: str, *, optimizers: Sequence[torch.optim.Optimizer] = (),
                        cpu_offload: bool = True) -> None:
    """Whether ``model.state_dict()`` and each optimizer's ``state_dict()`` give whole tensors (FSDP1's name).

    ``"sharded"`` (the default): every sharded value is this rank's piece, for DCP. ``"full"``: every
    call gathers whole tensors (``cpu_offload``: on the CPU), so savers that ``torch.save`` or
    ``safetensors``-save a state dict (accelerate's ``save_model`` / ``save_state``, a framework's
    full checkpoint) write whole, loadable tensors. In ``"full"`` mode a ``state_dict()`` call is a
    collective: every rank of the model's mesh makes it. Loading whole tensors needs no mode:
    ``load_state_dict`` (model and optimizer) takes them in either.
    """
    if state_dict_type not in ("full", "sharded"):
        raise ValueError(f"set_state_dict_type: state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}")
    module = getattr(model, "_orig_mod", model)
    for owner in (module, *optimizers):
        handle = owner.__dict__.pop(_FULL_HOOK, None)
        if handle is not None:
            handle.remove()
    if state_dict_type == "sharded":
        return

    def whole(values: Any) -> Any:
        return _whole_values(values, offload=cpu_offload)

    def model_hook(module, state_dict, prefix, local_metadata) -> None:
        if not prefix:  # the root's call: every value is in
            state_dict.update(whole(dict(state_dict)))

    def optimizer_hook(optimizer, state_dict):
        return whole_optimizer_state(state_dict, offload=cpu_offload)

    module.__dict__[_FULL_HOOK] = module.register_state_dict_post_hook(model_hook)
    for optimizer in optimizers:
        optimizer.__dict__[_FULL_HOOK] = optimizer.register_state_dict_post_hook(optimizer_hook)


def whole_optimizer_state(state_dict: dict[str, Any], *, offload: bool = True,
                          keep: bool = True) -> dict[str, Any] | None:
    """An optimizer's ``state_dict()`` with every sharded state gathered whole (``offload``: on the CPU);
    ``None`` unless ``keep`` (a rank that will not write). A collective: every rank calls it (the states
    are listed in the same order on every rank)."""
    states = _whole_values(state_dict["state"], offload=offload, keep=keep)
    return {**state_dict, "state": states} if keep else None


def _whole_values(tree: Any, *, offload: bool = False, keep: bool = True) -> Any:
    """``tree`` (a state dict, nested dicts and lists) with every sharded tensor replaced by its whole value.

    A collective: every rank walks the same tree in the same order. ``offload`` moves every tensor to
    the CPU; ``keep=False`` (a rank that will not write) takes part in each gather and drops the result
    at once, so it never holds more than one whole value.
    """
    if isinstance(tree, torch.Tensor):
        value = whole_tensor(tree) if holds_pieces(tree) else tree
        if not keep:
            return None
        return value.cpu() if offload else value
    if isinstance(tree, dict):
        return {k: _whole_values(v, offload=offload, keep=keep) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_whole_values(v, offload=offload, keep=keep) for v in tree)
    return tree


def _piece_of_whole_state(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A whole optimizer state of sharded ``param`` as this rank's piece, in the parameter's layout."""
    if holds_pieces(value) or value.dim() == 0 or tuple(value.shape) != tuple(param.shape):
        return value
    if isinstance(param, DTensor):
        block = local_block(value, param._spec)
        part = param._local_tensor
        start, end = part._spec.local_range
        piece = RaggedShardTensor(block.reshape(-1)[start:end].clone(), part._spec)
        return over_pieces(piece, param._spec)
    start, end = param._spec.local_range
    return RaggedShardTensor(value.reshape(-1)[start:end].clone(), param._spec)


_installed = False


def install_state_dict_api() -> None:
    """The optimizer hooks of [Note: torch's state-dict API on sharded models]; once per process, when
    a model is sharded. (The gather patch is ``torch_patches.install_full_state_dict_gather``.)"""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_shard_whole_states)
        _installed = True


_load_hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers whose loads cut states


def _hook_loads(optimizer: torch.optim.Optimizer) -> None:
    """Cut whole states of sharded parameters at every later ``load_state_dict`` of ``optimizer``."""
    if optimizer not in _load_hooked:
        _load_hooked.add(optimizer)
        # Before other post-hooks: flattening states into per-bucket buffers expects pieces.
        optimizer.register_load_state_dict_post_hook(_cut_loaded_states, prepend=True)


def _cut_loaded_states(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and is_sharded(p):
                optimizer.state[p] = _cut(p, state)


def _cut(param: torch.Tensor, value: Any) -> Any:
    """Every tensor in a loaded state (nested dicts and lists, as torch's load casts them) as its piece."""
    if isinstance(value, torch.Tensor):
        return _piece_of_whole_state(param, value)
    if isinstance(value, dict):
        return {k: _cut(param, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cut(param, v) for v in value)
    return value


# optimizer → {id(p): a weak reference to p} for its sharded parameters whose states were looked at since they
# were sharded; the reference is compared by identity, since a parameter made after one was freed may reuse its id
_states_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, weakref.ref]]" = \
    weakref.WeakKeyDictionary()


def _shard_whole_states(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    _hook_loads(optimizer)
    checked = _states_checked.setdefault(optimizer, {})
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen = checked.get(id(p))
            if seen is not None and seen() is p or not is_sharded(p):
                continue
            checked[id(p)] = weakref.ref(p)
            state = optimizer.state.get(p)
            if state:
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = _piece_of_whole_state(p, value)
