"""fully_shard: parameters become RaggedShard views of DBuffer shards, in place, and nothing else changes.

Multi-rank checks are grouped into one spawned run per world size (spawning costs seconds per
process); each ``_check_*`` function is one concern, and a failure's traceback names it. Errors on
bad input that do not depend on the ranks are checked in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.sharding.fully_shard import fully_shard
from fsdp_pass.buckets.dbuffer import DBuffer
from fsdp_pass.buckets.mesh import ShardingMesh
from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor
from fsdp_pass.sharding.buckets import ShardingConfig
from fsdp_pass.tensor.ragged_tensor import bucket_of, is_sharded
from fsdp_pass.sharding.materialize import shard_parameters
from fsdp_pass.testing.models import MLP, Llama, LlamaConfig


def _seeded(build):
    """Every rank must start from the same full parameters (as from one checkpoint): seed the init."""

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return make_model


MODELS = {"mlp": _seeded(MLP), "llama": _seeded(lambda: Llama(LlamaConfig()))}


def _buckets(model: nn.Module) -> list[DBuffer]:
    """The model's DBuffers, each once, in parameter order."""
    seen: dict[int, DBuffer] = {}
    for p in model.parameters():
        buf, _ = bucket_of(p)
        seen.setdefault(id(buf), buf)
    return list(seen.values())


def _assert_untouched(model: nn.Module, originals: dict[str, torch.Tensor]) -> None:
    """No parameter was swapped: an error left the module exactly as it was."""
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and not is_sharded(p), name
        assert torch.equal(p, originals[name]), name


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# checks (run on every rank)
# ---------------------------------------------------------------------------------------------


def _check_parameters_become_ragged_in_place(make_model, mesh: DeviceMesh | None) -> None:
    model = make_model()
    originals = _snapshot(model)
    buffers_before = {name: b.clone() for name, b in model.named_buffers()}
    ids_before = [id(p) for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    assert fully_shard(model, mesh) is model

    assert [id(p) for p in model.parameters()] == ids_before
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], model.parameters(), strict=True))
    for name, p in model.named_parameters():
        assert is_sharded(p) and isinstance(p, RaggedShardTensor) and isinstance(p, nn.Parameter), name
        assert p.requires_grad, name
        assert torch.equal(p.full_tensor(), originals[name]), name
    for name, b in model.named_buffers():
        assert type(b) is torch.Tensor and torch.equal(b, buffers_before[name]), name
    if isinstance(model, Llama):
        assert model.output.weight is model.tok_embeddings.weight  # still tied, sharded once


def _check_local_bytes_are_the_planned_shards(make_model, mesh: DeviceMesh | None, shard_world: int) -> None:
    model = make_model()
    fully_shard(model, mesh)
    buffers = _buckets(model)
    params = list(model.parameters())

    per_rank_bytes = sum(b.shard.numel() * b.shard.element_size() for b in buffers)
    assert per_rank_bytes == sum(b.layout.shard_size * b.dtype.itemsize for b in buffers)
    # Padding counted from the layout's own segments, independently of its shard size.
    padding_bytes = 0
    for b in buffers:
        padding = sum(size for name, size in b.layout.segments() if name is None)
        assert b.layout.shard_size * shard_world - b.layout.numel == padding, b
        padding_bytes += padding * b.dtype.itemsize
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    assert per_rank_bytes * shard_world == total_bytes + padding_bytes

    # Every piece lives inside its bucket's shard (no memory beyond the shards) ...
    for name, p in model.named_parameters():
        buf, bucket_name = bucket_of(p)
        start, end = buf.layout.shard_range(bucket_name, buf.rank)
        assert p._local.untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr(), name
        assert p._local.storage_offset() == buf.shard.storage_offset() + start and p._local.numel() == end - start
    # ... and the pieces of all ranks add up to whole tensors.
    local_numels = torch.tensor([p._local.numel() for p in params])
    sharding = buffers[0].mesh
    if sharding.mesh is not None:
        dist.all_reduce(local_numels, group=sharding.mesh.get_group(sharding.shard_dim))
    assert local_numels.tolist() == [p.numel() for p in params]


def _check_frozen_parameters_get_gradient_free_buckets(mesh: DeviceMesh | None) -> None:
    model = MLP()
    model.layers[1].requires_grad_(False)
    fully_shard(model, mesh)
    for name, p in model.named_parameters():
        buf, _ = bucket_of(p)
        trainable = not name.startswith("layers.1.")
        assert p.requires_grad == trainable and buf.shard.requires_grad == trainable, name
        assert all(q.requires_grad == trainable for q in buf.params.values()), buf  # never mixed in a bucket


def _check_second_call_is_a_no_op(mesh: DeviceMesh | None) -> None:
    model = Llama(LlamaConfig())
    fully_shard(model, mesh)
    state = [(bucket_of(p)[0], p._local.data_ptr(), p._local.storage_offset()) for p in model.parameters()]
    assert fully_shard(model, mesh) is model
    again = [(bucket_of(p)[0], p._local.data_ptr(), p._local.storage_offset()) for p in model.parameters()]
    assert all(a[0] is b[0] and a[1:] == b[1:] for a, b in zip(state, again, strict=True))


def _check_eager_call_matches_the_unsharded_model(make_model, mesh: DeviceMesh | None, example_input) -> None:
    """A sharded module still runs without torch.compile (eager/calls.py) and gives what it gave before."""
    model = make_model()
    expected = model(example_input).detach()
    fully_shard(model, mesh)
    with torch.no_grad():
        assert torch.allclose(model(example_input), expected, rtol=1e-5, atol=1e-6)


def _check_mesh_without_this_rank_is_rejected(world: int) -> None:
    """A mesh over a subset of the ranks shards over them; one that leaves this rank out is refused."""
    rank = dist.get_rank()
    model = MLP()
    originals = _snapshot(model)
    mesh = DeviceMesh("cpu", [0, 1])  # the same mesh on every rank: ranks 2 and 3 are not in it
    if rank < 2:
        fully_shard(model, mesh)
        assert all(bucket_of(p)[0].mesh.shard_size == 2 for p in model.parameters())
    else:
        with pytest.raises(ValueError, match=rf"fully_shard's mesh .* does not include this rank \({rank}\)"):
            fully_shard(model, mesh)
        _assert_untouched(model, originals)
    model = MLP()
    fully_shard(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"])
    assert all(bucket_of(p)[0].mesh.shard_size == 2 for p in model.parameters())


def _model_checks(mesh: DeviceMesh | None, shard_world: int) -> None:
    for make_model in MODELS.values():
        _check_parameters_become_ragged_in_place(make_model, mesh)
        _check_local_bytes_are_the_planned_shards(make_model, mesh, shard_world)
    _check_frozen_parameters_get_gradient_free_buckets(mesh)
    _check_second_call_is_a_no_op(mesh)
    _check_eager_call_matches_the_unsharded_model(MODELS["mlp"], mesh, torch.randn(3, 19))
    _check_eager_call_matches_the_unsharded_model(MODELS["llama"], mesh, torch.zeros(1, 8, dtype=torch.long))


def _run_on_ranks(rank: int, world: int) -> None:
    _model_checks(None, world)  # mesh=None: every rank of the default process group
    if world == 4:
        # HSDP: sharded over the last dim of a (replicate, shard) mesh.
        _model_checks(init_device_mesh("cpu", (2, 2)), shard_world=2)
        _check_mesh_without_this_rank_is_rejected(world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_on_gloo_ranks(world: int) -> None:
    run_distributed(_run_on_ranks, world)


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------


def test_fully_shard_without_a_process_group() -> None:
    """mesh=None and no process group: one rank holds every bucket whole."""
    assert not dist.is_initialized()
    _model_checks(None, shard_world=1)
    model = MLP()
    fully_shard(model)
    assert all(p.mesh is None and bucket_of(p)[0].mesh == ShardingMesh(None) for p in model.parameters())


def test_non_float_parameter_is_rejected_before_anything_is_sharded() -> None:
    for dtype in (torch.int64, torch.complex64):
        model = MLP()
        # Registered on the last layer, so earlier parameters would be swapped first if checks ran late.
        model.layers[2].register_parameter("extra", nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=False))
        originals = _snapshot(model)
        with pytest.raises(TypeError, match=rf"parameter 'layers\.2\.extra' has dtype {dtype}"):
            fully_shard(model)
        _assert_untouched(model, originals)


def test_block_size_not_dividing_a_parameter_is_rejected_before_anything_is_sharded() -> None:
    model = MLP()
    originals = _snapshot(model)
    with pytest.raises(ValueError, match=r"parameter 'layers\.2\.weight' of shape \(5, 23\)"):
        fully_shard(model, block_sizes={"layers.2.weight": {"elements": 7}})
    _assert_untouched(model, originals)
    # shard_parameters, called directly (as the backend does), checks its blocks before swapping too.
    with pytest.raises(ValueError, match=r"parameter 'layers\.2\.weight' of shape \(5, 23\)"):
        shard_parameters(model.named_parameters(), ShardingMesh(None), ShardingConfig(), {"layers.2.weight": 7})
    _assert_untouched(model, originals)


def test_aliased_parameter_is_rejected_before_anything_is_sharded() -> None:
    model = MLP()
    originals = _snapshot(model)
    alias = model.layers[2].weight.view(-1)  # a live view: the parameter cannot be swapped in place
    with pytest.raises(RuntimeError, match=r"cannot shard parameter 'layers\.2\.weight'"):
        fully_shard(model)
    _assert_untouched(model, originals)
    del alias
    fully_shard(model)  # dropping the view is the documented fix
    assert all(is_sharded(p) for p in model.parameters())


def test_mp_policy_sets_the_dtypes_of_eager_and_compiled_gathers() -> None:
    """fully_shard(mp_policy=...) as FSDP2's: eager calls and a graph compiled without options["mp_policy"]
    gather the shards in its param_dtype, the graph reduces in its reduce_dtype, the masters stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_pass.buckets.gather import gather_bucket
    from fsdp_pass.compile.backend import records

    torch._dynamo.reset()
    model = fully_shard(MLP(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    x = torch.randn(3, 19)
    assert model(x.bfloat16()).dtype == torch.bfloat16  # eager: the layers compute on bf16 whole weights
    before = set(map(id, records()))
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    compiled(x.bfloat16()).float().sum().backward()
    # the graph with parameters (the policy's input cast, a forward pre-hook, compiles as a frame of its own)
    (record,) = [r for r in records() if id(r) not in before and r.buffers]
    gathers = list(record.modules["rewritten"].graph.find_nodes(op="call_function", target=gather_bucket))
    assert gathers and all(n.kwargs["param_dtype"] == n.kwargs["reduce_dtype"] == torch.bfloat16 for n in gathers)
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="mp_policy param_dtype must be a floating torch.dtype"):
        fully_shard(MLP(), mp_policy={"param_dtype": torch.int8})


@pytest.mark.parametrize("accelerator", [None, "cuda"])
def test_the_mesh_made_without_one_is_on_the_current_accelerator_whatever_the_backend_is_named(
        monkeypatch, accelerator):
    """FSDP2's rule: ``mesh=None`` gives a mesh on the current accelerator when one is available, CPU
    otherwise; the backend's name says nothing (``cuda:nccl,cpu:gloo`` and a backend left to torch's choice
    are CUDA groups; here the fake group's "fake")."""
    from fsdp_pass.sharding import mesh_roles
    from fsdp_pass.testing.fake_pg import fake_process_group

    asked = []

    def recorded(device_type, shape):
        asked.append(device_type)
        return init_device_mesh("cpu", shape)  # a CPU build can make no CUDA mesh

    monkeypatch.setattr(mesh_roles, "init_device_mesh", recorded)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator is not None)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda *a, **k: None if accelerator is None else torch.device(accelerator))
    with fake_process_group(4):
        mesh_roles.resolve_mesh(None)
    assert asked == [accelerator or "cpu"]


def test_a_fully_shard_call_without_numbered_children_is_one_bucket() -> None:
    """FSDP2's recipe groups each block, and the root's embedding, norm and head, once each ([Note: a fully_shard
    call is one unit]); a whole model given to one call keeps a bucket per module unit."""
    from fsdp_pass.buckets.dbuffer import buffers_of

    cfg = LlamaConfig(layers=2, tie_embeddings=False)
    recipe = Llama(cfg)
    for block in recipe.layers:
        fully_shard(block, min_bucket_bytes=0)  # by module: a bucket per projection and norm
    fully_shard(recipe, min_bucket_bytes=0)
    assert [len(buffers_of(block)) for block in recipe.layers] == [1, 1]
    assert len(buffers_of(recipe)) == 2 + 1
    whole = fully_shard(Llama(cfg), min_bucket_bytes=0)
    assert [b.names for b in buffers_of(whole)] == [
        ["tok_embeddings.weight"], *[[n for n, _ in whole.named_parameters() if n.startswith(f"layers.{i}.")]
                                     for i in range(2)], ["norm.weight"], ["output.weight"]]
