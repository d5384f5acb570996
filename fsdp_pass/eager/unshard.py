"""``unshard``: every parameter of a sharded module as its whole tensor, for the duration of a block."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..buckets.dbuffer import DBuffer, is_unsharded, mark_unsharded
from ..tensor.ragged_tensor import bucket_of, is_sharded
from ..tensor.swap import swap_in_place

__all__ = ["unshard"]


@contextlib.contextmanager
def unshard(module: nn.Module, writeback: bool = False, *,
            parameters: Iterable[nn.Parameter] | None = None) -> Iterator[nn.Module]:
    """Gather every sharded parameter of ``module`` into its whole tensor for the ``with`` block.

    Inside the block each parameter object is a plain ``nn.Parameter`` holding the whole tensor:
    inspect it, call the module eagerly, or save ``module.state_dict()`` (Hugging Face
    ``save_pretrained``) on rank 0. Leaving the block puts the sharded parameters back with their
    identity, so optimizers built on them stay valid. With ``writeback=True`` the whole tensors'
    values (weight surgery, ``load_state_dict``) go back into the shards on exit, each rank
    writing its own piece from its own copy; if the block raises, nothing is written back.
    Gradients computed on the whole tensors inside the block are discarded.

    Like FSDP1's ``summon_full_params``, this is collective (every rank of the model's mesh enters
    the block) and holds the whole model on every rank while it lasts, each parameter in storage
    of its own (savers that deduplicate shared storage keep every tensor). Do not call the compiled
    model inside the block: call ``module`` itself.

        with fsdp_pass.unshard(model):
            if rank == 0:
                model.save_pretrained(out)    # or torch.save(model.state_dict(), path)

    ``parameters``: gather only these of ``module``'s parameters (an FSDP2 module's own, for its
    ``unshard()``).
    """
    named = list(module.named_parameters(remove_duplicate=True))
    if parameters is not None:
        chosen = {id(p) for p in parameters}
        named = [(name, p) for name, p in named if id(p) in chosen]
    nested = [name for name, p in named if is_unsharded(p)]
    if nested:
        raise ValueError(
            f"unshard: parameter {nested[0]!r} is already unsharded by an enclosing fsdp_pass.unshard block; "
            f"use the outer block's whole tensors instead of nesting"
        )
    sharded = [(name, p) for name, p in named if is_sharded(p)]
    if not sharded:
        raise ValueError(
            f"unshard: {type(module).__name__} has no sharded parameters; shard it first with "
            f'fsdp_pass.fully_shard(module) or run it once through torch.compile(module, backend="vescale")'
        )
    for name, p in sharded:
        if isinstance(p, DTensor):
            raise NotImplementedError(
                f"unshard: parameter {name!r} is a tensor/expert-parallel DTensor (placements {p.placements}); "
                f"read whole values with fsdp_pass.get_full_state_dict(module) instead"
            )
    members: dict[int, tuple[DBuffer, list[nn.Parameter]]] = {}
    for _, p in sharded:
        buf, _ = bucket_of(p)
        members.setdefault(id(buf), (buf, []))[1].append(p)

    swapped: list[tuple[nn.Parameter, nn.Parameter, DBuffer, str]] = []  # (parameter, its sharded self, bucket, name)
    completed = False
    try:
        for buf, params in members.values():
            views = buf.views(buf.all_gather())
            for p in params:
                _, name = bucket_of(p)
                # Its own storage, not a view of the gathered bucket: storage-based savers (accelerate's
                # clean_state_dict_for_safetensors, safetensors) keep one tensor per storage.
                whole = nn.Parameter(views[name].clone(), requires_grad=p.requires_grad)
                swap_in_place(p, whole)  # p is now the whole tensor; `whole` holds the sharded one
                mark_unsharded(p)
                swapped.append((p, whole, buf, name))
        yield module
        completed = True
    finally:
        _reshard(swapped, write=writeback and completed)


@torch.no_grad()
def _reshard(swapped: list[tuple[nn.Parameter, nn.Parameter, DBuffer, str]], write: bool) -> None:
    for p, sharded_self, buf, name in swapped:
        if write:
            buf.load_full(name, p)
        p.grad = None  # a gradient of the whole tensor has no place in the shards
        swap_in_place(p, sharded_self)
