"""What fsdp_pass changes in torch (docs/torch_changes.md): nothing at import; once a model is sharded,
the patches of fsdp_pass/interop/torch_patches.py, the registries and the hooks. Per patch and extension
point, the torch behaviour it relies on is pinned here (the attribute, its signature, who calls it with
what), so a torch upgrade that moves it fails here first."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import fsdp_pass
from fsdp_pass.interop.torch_patches import install_full_state_dict_gather
from fsdp_pass.tensor.ragged_tensor import RaggedLocalDTensor, RaggedShardTensor

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release

FULL = StateDictOptions(full_state_dict=True)


def test_importing_changes_nothing_in_torch_and_sharding_installs_it():
    script = """
import torch, torch.nn as nn
from torch.distributed.checkpoint import state_dict as sd
from torch.distributed.tensor import DTensor
from torch.optim import optimizer
from torch.utils import _foreach_utils
handlers = dict(DTensor._op_dispatcher._custom_op_handlers)
gather = sd._gather_state_dict
pre_hooks = len(optimizer._global_optimizer_pre_hooks)
import fsdp_pass
from fsdp_pass.tensor.ragged_tensor import RaggedLocalDTensor, RaggedShardTensor
assert sd._gather_state_dict is gather and DTensor._op_dispatcher._custom_op_handlers == handlers
for cls in (RaggedShardTensor, RaggedLocalDTensor):
    assert cls not in optimizer._foreach_supported_types + _foreach_utils._foreach_supported_types
assert len(optimizer._global_optimizer_pre_hooks) == pre_hooks
fsdp_pass.fully_shard(nn.Linear(2, 2))
assert sd._gather_state_dict.__wrapped__ is gather
for cls in (RaggedShardTensor, RaggedLocalDTensor):
    assert cls in optimizer._foreach_supported_types and cls in _foreach_utils._foreach_supported_types
assert len(optimizer._global_optimizer_pre_hooks) > pre_hooks
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# -- patch: torch.distributed.checkpoint.state_dict._gather_state_dict -----------------------------

def test_gather_state_dict_is_what_full_state_dicts_call():
    from torch.distributed import _state_dict_utils

    install_full_state_dict_gather()
    wrapper = torch_state_dict._gather_state_dict
    original = wrapper.__wrapped__
    assert original is _state_dict_utils._gather_state_dict
    params = inspect.signature(original).parameters
    assert list(params)[0] == "state_dict" and params["state_dict"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} >= {"cpu_offload", "ranks_only"}
    # Looked up by name in the module's globals at call time, so the reassigned name is the one called.
    caller = torch_state_dict._maybe_full_or_cpu_state_dict
    assert caller.__globals__ is vars(torch_state_dict) and "_gather_state_dict" in caller.__code__.co_names

    calls = []

    def spy(state_dict, *args, **kwargs):
        calls.append((state_dict, args, kwargs))
        return wrapper(state_dict, *args, **kwargs)

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch_state_dict._gather_state_dict = spy
    try:
        model_sd = get_model_state_dict(model, options=FULL)
        optim_sd = get_optimizer_state_dict(model, opt, options=FULL)
    finally:
        torch_state_dict._gather_state_dict = wrapper
    assert len(calls) == 2 and not calls[0][1] and not calls[1][1], calls  # the state dict alone is positional
    assert set(calls[0][0]) == {"weight", "bias"} and set(calls[1][0]) == {"state", "param_groups"}
    assert torch.equal(model_sd["weight"], model.weight.detach())
    assert torch.equal(optim_sd["state"]["weight"]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])


def test_torch_gathers_dtensors_only():
    """The patch's reason: torch hands any other tensor subclass (a RaggedShard piece) through as is."""
    from torch.distributed import _state_dict_utils

    piece = fsdp_pass.distribute_tensor(torch.arange(6.0).view(2, 3), None, fsdp_pass.RaggedShard(1, (6,)))
    out = _state_dict_utils._gather_state_dict({"w": piece}, type_check=False)
    assert out["w"] is piece


# -- hooks: optimizer load_state_dict post-hooks and the global step pre-hook ---------------------

def test_optimizer_hooks_cut_whole_states_of_sharded_parameters():
    """``Optimizer.load_state_dict`` runs load post-hooks after the states are in (``prepend`` exists);
    a never-stepped optimizer gets its whole states cut by the global step pre-hook."""
    assert "prepend" in inspect.signature(torch.optim.Optimizer.register_load_state_dict_post_hook).parameters
    model = fsdp_pass.fully_shard(nn.Linear(3, 2))  # one process: a piece is the whole tensor
    whole = {"state": {0: {"momentum_buffer": torch.ones(2, 3)}, 1: {"momentum_buffer": torch.ones(2)}},
             "param_groups": [{"lr": 0.1, "momentum": 0.9, "dampening": 0, "weight_decay": 0, "nesterov": False,
                               "maximize": False, "foreach": None, "differentiable": False, "fused": None,
                               "params": [0, 1]}]}
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(whole)  # not stepped: no hook yet, cut before its first step
    assert type(fresh.state[model.weight]["momentum_buffer"]) is torch.Tensor
    model(torch.ones(1, 3)).sum().backward()
    fresh.step()
    assert isinstance(fresh.state[model.weight]["momentum_buffer"], RaggedShardTensor)
    fresh.load_state_dict(whole)  # stepped: cut at load
    assert all(isinstance(fresh.state[p]["momentum_buffer"], RaggedShardTensor) for p in model.parameters())


# -- extension point: RaggedLocalDTensor, a DTensor subclass ---------------------------------------

def test_dtensor_subclass_contract():
    """A DTensor subclass dispatches through ``DTensor.__torch_dispatch__``; its class can be swapped in
    place (same slots); our overrides take DTensor's arguments; tracing unflattens to a plain DTensor."""
    assert "__torch_dispatch__" in vars(DTensor) and DTensor.__slots__ == ["_local_tensor", "_spec"]
    assert RaggedLocalDTensor.__slots__ == ()
    for name in ("full_tensor", "redistribute"):
        ours = inspect.signature(getattr(RaggedLocalDTensor, name)).parameters
        theirs = inspect.signature(getattr(DTensor, name)).parameters
        assert [(n, p.kind) for n, p in ours.items()] == [(n, p.kind) for n, p in theirs.items()], name
    source = inspect.getsource(DTensor.full_tensor)
    assert "self.redistribute(" in source  # torch's full_tensor reaches our redistribute on a subclass
    assert inspect.getsource(DTensor.__tensor_unflatten__).count("return DTensor(") == 1


# -- registries -----------------------------------------------------------------------------------

def test_registries_exist_and_are_read():
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    assert isinstance(optimizer._foreach_supported_types, list)
    assert isinstance(_foreach_utils._foreach_supported_types, list)
    assert "_foreach_supported_types" in inspect.getsource(optimizer._default_to_fused_or_foreach)
    assert "_foreach_supported_types" in inspect.getsource(_foreach_utils._has_foreach_support)
    assert isinstance(DTensor._op_dispatcher._custom_op_handlers, dict)
