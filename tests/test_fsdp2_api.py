"""FSDP2's module API and policies on what ``fsdp_pass.fully_shard`` returns (one process, no process group)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard

import fsdp_pass
from fsdp_pass.buckets.dbuffer import buffers_of
from fsdp_pass.sharding.fsdp_module import FSDPPassModule
from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor, bucket_of, is_sharded
from fsdp_pass.testing.models import MLP

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release


def _nested() -> MLP:
    """An MLP with ``layers.0`` sharded by its own call, then the rest by the root's (FSDP2's bottom-up order)."""
    model = MLP()
    fsdp_pass.fully_shard(model.layers[0])
    fsdp_pass.fully_shard(model)
    return model


def test_every_fsdp_module_method_is_fsdp_passs_own():
    """No torch FSDPModule implementation (which reads FSDP2's hook state) is reachable on a swapped module."""
    torch_methods = {name for name, value in vars(FSDPModule).items() if callable(value) and name != "__new__"}
    missing = sorted(torch_methods - set(vars(FSDPPassModule)))
    assert not missing, f"FSDPModule methods that fall through to torch's implementation: {missing}"
    # the import refuses a method it does not know; each must be given its meaning here
    unreviewed = sorted(n for n in torch_methods if getattr(vars(FSDPPassModule)[n], "unreviewed", False))
    assert not unreviewed, f"FSDPModule methods newer than fsdp_pass, refused without a meaning: {unreviewed}"


def test_class_swap_keeps_keys_and_survives_copies_and_compile():
    model = MLP()
    keys = list(model.state_dict())
    reference = copy.deepcopy(model)
    returned = fsdp_pass.fully_shard(model)
    assert returned is model and type(model).__name__ == "FSDPMLP" and isinstance(model, (FSDPModule, MLP))
    assert list(model.state_dict()) == keys
    assert type(MLP()) is MLP  # the swap touches one object, not the class
    copied = copy.deepcopy(model)
    assert type(copied) is type(model) and list(copied.state_dict()) == keys
    assert all(isinstance(p, RaggedShardTensor) for p in copied.parameters())
    assert torch.equal(copied.layers[0].weight.full_tensor(), reference.layers[0].weight)
    # Pickle: RaggedShardTensor parameters do not pickle (a piece of one rank); the swapped class does.
    plain = MLP()
    whole = fsdp_pass.fully_shard(plain, ignored_params=set(plain.parameters()))
    unpickled = pickle.loads(pickle.dumps(whole))
    assert type(unpickled) is type(whole) and list(unpickled.state_dict()) == keys
    assert torch.equal(unpickled.layers[0].weight, plain.layers[0].weight)
    # torch.compile of the swapped module trains like the plain module (one process: every bucket whole).
    x = torch.randn(4, 19)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    compiled(x).square().mean().backward()
    reference(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_gradient_settings_reach_the_module_own_buckets():
    model = _nested()
    inner, outer = buffers_of(model.layers[0]), [b for b in buffers_of(model) if b not in buffers_of(model.layers[0])]
    assert inner and outer
    model.set_requires_gradient_sync(False, recurse=False)  # the root's own parameters only, as FSDP2's
    assert all(b.gradient_sync for b in inner) and not any(b.gradient_sync for b in outer)
    model.set_requires_gradient_sync(False)
    assert not any(b.gradient_sync for b in inner + outer)
    model.layers[0].set_gradient_divide_factor(2.0)
    assert all(b.grad_divisor == 2.0 for b in inner) and all(b.grad_divisor != 2.0 for b in outer)
    model.set_reduce_scatter_divide_factor(3.0)
    assert all(b.grad_divisor == 3.0 for b in outer)
    model.set_reshard_after_forward(False, recurse=False)
    assert all(b.reshard_after_forward is True for b in inner) and all(b.reshard_after_forward is False for b in outer)
    with pytest.raises(ValueError, match="set_reshard_after_forward takes a bool"):
        model.set_reshard_after_forward(2)
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    for call in (lambda: model.set_is_last_backward(False), lambda: model.set_reshard_after_backward(False),
                 lambda: model.set_modules_to_forward_prefetch([model.layers[0]]),
                 lambda: model.set_modules_to_backward_prefetch([model.layers[0]]),
                 lambda: model.set_all_reduce_hook(lambda t: None), model.reset_iter_state, model._get_fsdp_state):
        with pytest.raises(NotImplementedError, match="is not supported on a module sharded by fsdp_pass: .*"):
            call()


def test_unshard_and_reshard_as_fsdp2_handles():
    model = _nested()
    outer_weight, inner_weight = model.layers[2].weight, model.layers[0].weight
    handle = model.unshard(async_op=True)
    handle.wait()
    assert not is_sharded(outer_weight) and outer_weight.shape == (5, 23)
    assert is_sharded(inner_weight)  # not recursive, as FSDP2's
    assert model.unshard() is None  # a no-op when already unsharded
    model.reshard()
    model.reshard()  # a no-op when sharded
    assert is_sharded(outer_weight) and outer_weight is model.layers[2].weight
    model.unshard()
    model(torch.randn(2, 19)).sum().backward()  # an eager backward on whole tensors: its gradient has no place
    with pytest.raises(RuntimeError, match="got a gradient while unsharded"):
        model.reshard()
    assert is_sharded(outer_weight)


def test_mixed_precision_policy_field_by_field():
    x = torch.randn(3, 19)
    bf16_out = fsdp_pass.fully_shard(MLP(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert bf16_out(x).dtype == torch.bfloat16  # cast_forward_inputs (default True): fp32 input runs in bf16
    fp32_out = fsdp_pass.fully_shard(MLP(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                           output_dtype=torch.float32))
    assert fp32_out(x).dtype == torch.float32
    uncast = fsdp_pass.fully_shard(MLP(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                         cast_forward_inputs=False))
    with pytest.raises(RuntimeError):  # an fp32 input meets bf16 weights, as under FSDP2 without the cast
        uncast(x)
    assert uncast(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(Exception, match="has an output_dtype, which a compile option cannot apply"):
        torch.compile(nn.Linear(2, 2), backend="vescale",
                      options={"mp_policy": MixedPrecisionPolicy(output_dtype=torch.float32)})(torch.randn(1, 2))


def test_reshard_after_forward_none_is_false_for_the_root_only():
    model = MLP()
    fsdp_pass.fully_shard(model.layers[0], reshard_after_forward=None)
    assert all(b.reshard_after_forward is False for b in buffers_of(model.layers[0]))  # a root until enclosed
    fsdp_pass.fully_shard(model, reshard_after_forward=None)
    inner = buffers_of(model.layers[0])
    assert all(b.reshard_after_forward is True for b in inner)
    assert all(b.reshard_after_forward is False for b in buffers_of(model) if b not in inner)


def test_ignored_params_stay_whole_through_fully_shard_and_the_backend():
    model = MLP()
    ignored = model.layers[2].weight
    fsdp_pass.fully_shard(model, ignored_params={ignored})
    assert not is_sharded(ignored) and all(is_sharded(p) for p in model.parameters() if p is not ignored)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    compiled(torch.randn(2, 19)).sum().backward()
    assert model.layers[2].weight is ignored and not is_sharded(ignored) and ignored.grad.shape == (5, 23)


def test_offload_policy_and_shard_placement_fn():
    fsdp_pass.fully_shard(MLP(), offload_policy=OffloadPolicy())  # FSDP2's default: no offload
    with pytest.raises(NotImplementedError, match="CPU offload is not supported yet"):
        fsdp_pass.fully_shard(MLP(), offload_policy=CPUOffloadPolicy())
    model = fsdp_pass.fully_shard(MLP(), shard_placement_fn=lambda p: Shard(0) if p.dim() == 2 else None)
    for name, p in model.named_parameters():
        buf, key = bucket_of(p)
        spec = next(s for s in buf.layout.specs if s.name == key)
        assert spec.block == (p.shape[1] if p.dim() == 2 else 1), name  # Shard(0): one row a block
    with pytest.raises(ValueError, match=r"shard_placement_fn returned Shard\(dim=1\) for parameter 'layers.0.weight'"):
        fsdp_pass.fully_shard(MLP(), shard_placement_fn=lambda p: Shard(1))


def test_dp_mesh_dims_and_module_lists():
    """FSDP2's dp_mesh_dims names the same dims as shard_dim / replicate_dim (a fake 2x2 group: planning only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims

    from fsdp_pass.testing.fake_pg import fake_process_group

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
        by_dims = fsdp_pass.fully_shard(MLP(), mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="rep"))
        by_names = fsdp_pass.fully_shard(MLP(), mesh, shard_dim="dp", replicate_dim="rep")
        assert [b.mesh for b in buffers_of(by_dims)] == [b.mesh for b in buffers_of(by_names)]
        assert buffers_of(by_dims)[0].mesh.shard_size == 2
        with pytest.raises(ValueError, match="got dp_mesh_dims and shard_dim/replicate_dim"):
            fsdp_pass.fully_shard(MLP(), mesh, shard_dim="dp", dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    with pytest.raises(TypeError, match="fully_shard of a list of modules"):
        fsdp_pass.fully_shard([MLP(), MLP()])


def test_reshard_after_forward_changed_after_the_compile_refuses_to_train():
    model = fsdp_pass.fully_shard(MLP())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    compiled(torch.randn(2, 19)).sum().backward()
    model.set_reshard_after_forward(False)
    with torch.no_grad():
        compiled(torch.randn(2, 19))  # no backward: the setting has nothing to change
    with pytest.raises(Exception, match=r"now has reshard_after_forward=False, but its compiled graph was made with True"):
        compiled(torch.randn(2, 19))



def test_frameworks_take_their_fsdp2_path_on_a_fully_shard_module():
    """isinstance(m, FSDPModule) holds, so the frameworks' own FSDP2 code runs on the module and calls its methods."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from lightning.fabric.strategies.model_parallel import _FSDPNoSync
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    model = _nested()
    buckets = buffers_of(model)
    with _FSDPNoSync(model, enabled=True):  # Lightning: set_requires_gradient_sync(flag, recurse=False) per FSDPModule
        assert not any(b.gradient_sync for b in buckets)
    assert all(b.gradient_sync for b in buckets)
    model.set_gradient_divide_factor(4.0)
    model.layers[0].set_gradient_divide_factor(4.0)
    disable_fsdp_gradient_division(model)  # torchtitan: set_gradient_divide_factor(1.0) per FSDPModule
    assert all(b.grad_divisor == 1.0 for b in buckets)
    assert fsdp2_prepare_model(None, model) is model  # accelerate's FSDP2 path leaves an FSDPModule as it is
    for module in model.modules():  # transformers' Trainer before it builds the optimizer
        if isinstance(module, FSDPModule):
            module.reshard()
    assert all(is_sharded(p) for p in model.parameters())
