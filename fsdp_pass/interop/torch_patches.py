"""The torch attributes fsdp_pass reassigns: each one's reason, installed when a model is sharded.

Everything else fsdp_pass changes in torch goes through torch's extension points (hooks, registries,
subclasses); docs/torch_changes.md lists all of it. A patch lives here only when no extension point
reaches the call, and tests/test_torch_patches.py pins what it relies on in torch (the attribute, its
signature, who calls it and with what), so a torch upgrade that moves it fails a test, not a run.
Each section: the patch, its reason, its install function (idempotent).
"""

from __future__ import annotations

import functools

__all__ = ["install_full_state_dict_gather"]


# -- full state dicts: torch.distributed.checkpoint.state_dict._gather_state_dict -------------------
# What: torch's get_model_state_dict / get_optimizer_state_dict / get_state_dict with
# full_state_dict=True hand the state dict to this module-level function (through
# _maybe_full_or_cpu_state_dict); the wrapper first replaces every sharded tensor by its whole value
# (a collective on every rank), then runs torch's function unchanged (CPU offload, rank-0-only).
# Why a patch: torch gathers DTensors and ShardedTensors only and hands every other tensor through
# as is, so a RaggedShard parameter and its optimizer states would come back as this rank's piece.
# No hook sees the full_state_dict option (model and optimizer state_dict hooks run the same for a
# sharded DCP save), and making the sharded state dict's values DTensors would change what
# state_dict() and DCP get. TP/EP parameters alone would need nothing: they are RaggedLocalDTensors
# ([Note: DTensors over RaggedShard local tensors]). See [Note: torch's state-dict API on sharded models].

_PATCHED = "_fsdp_pass_patch"  # on a wrapper installed here


def install_full_state_dict_gather() -> None:
    """Wrap ``torch.distributed.checkpoint.state_dict._gather_state_dict`` (once per process)."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    from .state_dict import _whole_values

    gather = torch_state_dict._gather_state_dict
    if getattr(gather, _PATCHED, False):
        return

    @functools.wraps(gather)
    def gather_whole(state_dict, *args, **kwargs):
        return gather(_whole_values(state_dict), *args, **kwargs)

    setattr(gather_whole, _PATCHED, True)
    torch_state_dict._gather_state_dict = gather_whole
