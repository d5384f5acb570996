"""The torch attributes fsdp_pass reassigns: each one's reason, installed when a model is sharded.

Everything else fsdp_pass changes in torch goes through torch's extension points (hooks, registries,
subclasses); docs/torch_changes.md lists all of it. A patch lives here only when no extension point
reaches the call, and tests/test_torch_patches.py pins what it relies on in torch (the attribute, its
signature, who calls it and with what), so a torch upgrade that moves it fails a test, not a run.
Each section: the patch, its reason, its install function (idempotent).
"""

from __future__ import annotations

import functools

__all__ = ["install_full_state_dict_gather", "install_wrapper_refusals"]


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


# -- wrappers around a sharded model: DDP's and FSDP1's constructors, FSDP2's _verify_managed_param --
# What: DistributedDataParallel.__init__ and FullyShardedDataParallel.__init__ are wrapped to run
# refuse_sharded_module(module) before torch's constructor; FSDP2's
# torch.distributed.fsdp._fully_shard._fsdp_init._verify_managed_param, which fully_shard's
# _get_managed_states calls (a module global, looked up at call time) for every parameter it would
# manage, is wrapped to run refuse_sharded_parameter(param) first. See [Note: wrappers around a
# sharded model] in wrapper_check.py.
# Why a patch: nothing torch asks of the module or its parameters can refuse in time. DDP's
# constructor looks up the default process group before it reads the module, then reads only the
# module it is handed (_ddp_params_and_buffers_to_ignore), not a sharded one inside a container.
# FSDP1 and FSDP2 look at every submodule through the composable-API registry (a getattr a sharded
# module could answer), but torch's get_state_dict reads the same registry of every submodule
# (FSDP.fsdp_modules) and a registry cannot tell who asks; FSDP2's per-parameter check asks
# len(param.shape), which the parameter's type never sees. tests/test_interop.py pins the three
# targets (test_torch_patch_targets_still_exist).

def install_wrapper_refusals() -> None:
    """Wrap DDP's and FSDP1's constructors and FSDP2's parameter check to refuse sharded modules (once)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._fully_shard import _fsdp_init
    from torch.nn.parallel import DistributedDataParallel

    from .wrapper_check import refuse_sharded_module, refuse_sharded_parameter

    for wrapper in (DistributedDataParallel, FullyShardedDataParallel):
        if not getattr(wrapper.__init__, _PATCHED, False):
            wrapper.__init__ = _refusing_sharded_modules(wrapper.__init__, wrapper.__name__, refuse_sharded_module)
    verify = getattr(_fsdp_init, "_verify_managed_param", None)  # gone in a later torch: the pinning test says so
    if verify is not None and not getattr(verify, _PATCHED, False):
        @functools.wraps(verify)
        def refusing_verify(name, param, *args, **kwargs):
            refuse_sharded_parameter(param)
            return verify(name, param, *args, **kwargs)

        setattr(refusing_verify, _PATCHED, True)
        _fsdp_init._verify_managed_param = refusing_verify


def _refusing_sharded_modules(init, wrapper_name: str, refuse):
    @functools.wraps(init)
    def refusing_init(self, module, *args, **kwargs):
        refuse(wrapper_name, module)
        init(self, module, *args, **kwargs)

    setattr(refusing_init, _PATCHED, True)
    return refusing_init

