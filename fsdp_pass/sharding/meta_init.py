"""Initialize parameters of a model built on the meta device, one module at a time, into their shards.

Only the local shards are ever allocated for the whole model. Each module's own ``reset_parameters``
runs on temporary full-size tensors of that module's parameters, and this rank's pieces are copied
into the DBuffers, so the peak is the local share plus one module's parameters. Modules are visited
in ``model.modules()`` order, the order their constructors would have drawn random numbers, so a
seeded meta-device model gets the values the same model built on a real device would.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime.dbuffer import bucket_of, is_sharded

__all__ = ["initialize_meta_parameters", "meta_parameter_owners"]


def meta_parameter_owners(module: nn.Module, meta_ids: set[int]) -> list[nn.Module]:
    """Modules holding the parameters in ``meta_ids``, in init order; raises if one cannot initialize."""
    owners = [m for m in module.modules() if any(id(p) in meta_ids for p in m.parameters(recurse=False))]
    missing = [type(m).__name__ for m in owners if not callable(getattr(m, "reset_parameters", None))]
    if missing:
        raise TypeError(
            f"cannot initialize meta-device parameters of {sorted(set(missing))}: these modules have no "
            f"reset_parameters(); define one (it fills self's parameters in place), or build the model "
            f"on a real device"
        )
    return owners


def initialize_meta_parameters(owners: list[nn.Module], meta_ids: set[int], device: torch.device) -> None:
    """Fill the shards of the sharded parameters listed in ``meta_ids`` with their modules' init."""
    done: set[int] = set()
    for owner in owners:
        originals = dict(owner._parameters)
        temporary = {
            name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            for name, p in originals.items() if p is not None
        }
        try:
            owner._parameters.update(temporary)
            with torch.no_grad():
                owner.reset_parameters()
        finally:
            owner._parameters.update(originals)
        for name, p in originals.items():
            if p is None or id(p) not in meta_ids or id(p) in done or not is_sharded(p):
                continue  # tied weights keep the first module's initialization
            buf, fqn = bucket_of(p)
            buf.load_full(fqn, temporary[name])
            done.add(id(p))
        del temporary  # before the next module allocates: one module's full tensors at a time
