"""What frameworks call on a sharded model: ``Module._apply``, FSDP2's meta-device flow, in-place
init ops, the gradient divide factor, settings made before sharding, wrappers and stale meshes,
torch's state-dict API (with fsdp_pass's own optimizers too), ``full_tensor``/``redistribute`` of
FSDP-over-TP parameters, and storage-based savers.

One spawned process group per world size runs every multi-rank case ([Note: Module._apply on
sharded parameters], [Note: buffers left on the meta device], [Note: settings recorded before
sharding], [Note: wrappers around a sharded model], [Note: DTensors over RaggedShard local tensors],
[Note: storage of a sharded tensor]).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import re
import tempfile

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_pass
from fsdp_pass.optim import AdamW8bit, Muon, muon_param_groups
from fsdp_pass.buckets.dbuffer import buffers_of
from fsdp_pass.tensor.ragged_tensor import is_sharded
from fsdp_pass.interop.state_dict import whole_tensor
from fsdp_pass.testing.models import MLP, Llama, LlamaConfig, init_std, lm_loss, random_tokens
from fsdp_pass.testing.spawn import run_distributed

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release

CFG = LlamaConfig(vocab=64, dim=32, ffn=48, heads=2, kv_heads=2, layers=2, seq=8)
AOT = {"compiler": "aot_eager"}
TOLERANCE = 1e-6  # relative, fp32 training after the call (one process sums the batch in another order)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _init_weights(model: Llama) -> None:
    """A torchtitan-style ``init_weights``: torch.nn.init on every parameter, and the rope table."""
    with torch.no_grad():
        nn.init.normal_(model.tok_embeddings.weight)
        for layer in model.layers:
            for name, p in layer.named_parameters():
                if p.dim() > 1:
                    nn.init.trunc_normal_(p, std=0.02) if "attn" in name else nn.init.kaiming_uniform_(p, a=5 ** 0.5)
                else:
                    nn.init.ones_(p)
        nn.init.ones_(model.norm.weight)
        head_dim = CFG.dim // CFG.heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=model.freqs.device).float() / head_dim))
        model.freqs.copy_(torch.outer(torch.arange(CFG.seq).float(), inv))


# -- one process ---------------------------------------------------------------------------------


def test_apply_keeps_parameters_in_their_buckets():
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    fsdp_pass.fully_shard(model)
    before = [(p, p.to_local()) for p in model.parameters()]
    model.to("cpu").cpu().float().train().eval().requires_grad_(True).to_empty(device="cpu")
    for (p, piece), q in zip(before, model.parameters()):
        assert p is q and is_sharded(q) and q.to_local() is piece  # the same object, piece and bucket
    x = torch.randn(4, 19)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("call, match", [
    (lambda m: m.half(), r"MLP|Linear.weight \(parameter 'layers.0.weight', shape \(37, 19\)\).*mp_policy"),
    (lambda m: m.to(torch.bfloat16), r"torch.float32 -> torch.bfloat16.*mp_policy"),
    (lambda m: m.to("meta"), r"moving a sharded model to meta is not supported"),
])
def test_apply_refuses_dtype_and_device_changes_untouched(call, match):
    model = MLP()
    model.register_buffer("scale", torch.ones(3))
    fsdp_pass.fully_shard(model)
    with pytest.raises((TypeError, ValueError), match=match):
        call(model)
    assert model.scale.dtype == torch.float32 and model.scale.device.type == "cpu"  # nothing changed
    assert all(p.dtype == torch.float32 and is_sharded(p) for p in model.parameters())


def test_apply_reaches_sharded_modules_through_plain_parents_and_the_backend():
    """A framework's container and the compiled wrapper reach the sharded modules' own ``_apply``, whether
    ``fully_shard`` or the backend sharded them; giving it while Dynamo traces costs no recompile."""
    torch.manual_seed(0)
    x = torch.randn(4, 19)
    for shard in ("fully_shard", "backend"):
        torch._dynamo.reset()
        model = MLP()
        reference = copy.deepcopy(model)
        compiled = torch.compile(model, backend="vescale", options=AOT)
        if shard == "fully_shard":
            fsdp_pass.fully_shard(model)
        else:
            compiled(x)  # the backend shards at the first call
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            compiled(x)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        assert all("_apply" in vars(m) for m in (model, model.layers, *model.layers))
        outer = nn.Sequential(compiled)
        before = [(p, p.to_local()) for p in model.parameters()]
        outer.to("cpu").float().to_empty(device="cpu")
        assert all(p is q and q.to_local() is piece for (p, piece), q in zip(before, model.parameters()))
        refused = r"Linear.weight \(parameter 'layers.0.weight', shape \(37, 19\)\).*mp_policy"
        with pytest.raises(TypeError, match=refused):
            outer.half()
        assert all(p.dtype == torch.float32 and is_sharded(p) for p in model.parameters())
        assert torch.equal(model(x), reference(x))


@pytest.mark.filterwarnings("ignore:backward hook")  # pickling a parameter drops its hooks
def test_sharded_modules_keep_their_classes_and_copies_keep_their_shards():
    model = MLP()
    model.act = nn.ReLU()  # holds no parameter: keeps torch's method
    fsdp_pass.fully_shard(model)
    # the sharded module's class is swapped for FSDP2's FSDP<Cls> (sharding/fsdp_module.py); its children keep theirs
    assert type(model).__name__ == "FSDPMLP" and type(model).__bases__[-1] is MLP and type(model.layers[0]) is nn.Linear
    assert "_apply" in vars(model) and "_apply" in vars(model.layers) and "_apply" not in vars(model.act)
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded).__name__ == "FSDPMLP" and isinstance(loaded, MLP)
    assert loaded.layers[1]._apply._module() is loaded.layers[1]
    copied = copy.deepcopy(model)
    assert copied.layers[0]._apply._module() is copied.layers[0]
    with pytest.raises(TypeError, match="mp_policy"):
        copied.half()
    x = torch.randn(4, 19)
    assert torch.equal(copied.to("cpu")(x), model(x))


def test_torch_patch_targets_still_exist():
    """What fsdp_pass/interop/torch_patches.py's wrapper refusals rely on in torch (see its section)."""
    import inspect

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._fully_shard import _fsdp_init
    from torch.nn.parallel import DistributedDataParallel

    for wrapper in (DistributedDataParallel, FullyShardedDataParallel):  # the module is __init__'s first argument
        assert list(inspect.signature(inspect.unwrap(wrapper.__init__)).parameters)[:2] == ["self", "module"]
    verify = inspect.unwrap(_fsdp_init._verify_managed_param)
    assert list(inspect.signature(verify).parameters) == ["name", "param"]
    # fully_shard's states reach it as a module global, looked up at call time
    assert "_verify_managed_param" in _fsdp_init._get_managed_states.__code__.co_names
    assert _fsdp_init._get_managed_states.__globals__ is vars(_fsdp_init)


def test_ddp_and_fsdp1_are_refused_with_the_fix():
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    model = MLP()
    fsdp_pass.fully_shard(model)
    for wrapper in (DistributedDataParallel, FullyShardedDataParallel):
        with pytest.raises(ValueError, match=r"already synchronizes gradients: do not wrap.*docs/integrations.md"):
            wrapper(model)


def test_fsdp2_fully_shard_is_refused_with_the_fix(four_fake_ranks):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = MLP()
    fsdp_pass.fully_shard(model, init_device_mesh("cpu", (4,)))
    expected = (r"FSDP2's fully_shard was asked to manage parameter 'layers\.0\.weight' \(shape \(\d+, \d+\)\)"
                r".*do not also call torch.distributed.fsdp.fully_shard")
    with pytest.raises(ValueError, match=expected):
        fully_shard(model, mesh=init_device_mesh("cpu", (4,)))


def test_eager_calls_follow_the_compiled_mp_policy():
    """torchtitan's chunked loss runs the output layer eagerly on the compiled body's bf16 output."""
    torch.manual_seed(0)
    model = Llama(CFG)
    compiled = torch.compile(model, backend="vescale",
                             options={**AOT, "mp_policy": {"param_dtype": torch.bfloat16}})
    tokens = random_tokens(CFG, 2, seed=0)
    assert compiled(tokens).dtype == torch.bfloat16
    hidden = torch.randn(2, CFG.seq, CFG.dim, dtype=torch.bfloat16)
    out = model.output(hidden)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    assert model.output.weight.grad.dtype == torch.float32  # the master dtype


def test_divide_factor_bad_input():
    model = MLP()
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="must be a positive number"):
            fsdp_pass.set_gradient_divide_factor(model, bad)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"options\['gradient_divide_factor'\] must be"):
        torch.compile(model, backend="vescale", options={"gradient_divide_factor": 0})(torch.ones(2, 19))


# -- several ranks, one spawned group each ---------------------------------------------------------


def _meta_flow(rank: int, world: int) -> dict:
    """Shard on meta, ``to_empty``, the model's own init: bit-equal to one process, generator included."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = Llama(CFG)
    torch.manual_seed(1)
    _init_weights(reference)
    after_reference = torch.rand(4)
    with torch.device("meta"):
        model = Llama(CFG)
    fsdp_pass.fully_shard(model, init="skip")
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    _init_weights(model)
    assert torch.equal(torch.rand(4), after_reference), "the generator state after the init differs"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    assert torch.equal(model.freqs, reference.freqs)
    return _train_both(model, reference, rank, world, steps=2) if world == 2 else {}


def _train_both(model: nn.Module, reference: nn.Module, rank: int, world: int, steps: int = 3,
                eager_steps: int = 1, options: dict | None = None) -> dict:
    """AdamW with clipping, compiled then eager steps, against one process on the global batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="vescale", options={**AOT, **(options or {})})
    worst = 0.0
    per_rank = 8 // world
    for step in range(steps + eager_steps):
        tokens = random_tokens(CFG, 8, seed=step)
        run = compiled if step < steps else model
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        loss = lm_loss(run(mine), mine)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(reference(tokens), tokens)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        worst = max(worst, abs(global_loss.item() / world - ref_loss.item()) / abs(ref_loss.item()))
    params = max(_rel(p.full_tensor(), q) for p, q in zip(model.parameters(), reference.parameters()))
    assert worst <= TOLERANCE and params <= 1e-5, (worst, params)
    return {"loss_rel": worst, "param_rel": params}


def _to_after_sharding(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = init_std(Llama(CFG))
    reference = copy.deepcopy(model)
    fsdp_pass.fully_shard(model)
    model.to("cpu")  # what Trainer, accelerate and Lightning call
    model.float().train()
    return _train_both(model, reference, rank, world)


def _gradients(model: nn.Module, tokens: torch.Tensor, rank: int, world: int, compiled: bool) -> list[torch.Tensor]:
    per_rank = tokens.shape[0] // world
    mine = tokens[rank * per_rank:(rank + 1) * per_rank]
    run = torch.compile(model, backend="vescale", options=AOT) if compiled else model
    lm_loss(run(mine), mine).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    model.zero_grad()
    return grads


def _divide_factor(rank: int, world: int, mesh_shape=None) -> dict:
    """Factor 1.0 (set before the backend shards): the sum over ranks, world x the mean, compiled and eager;
    flat, also accumulated under ``no_sync`` (a second compiled variant); with ``mesh_shape``, on 2x2 HSDP."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = init_std(Llama(CFG))
    tokens = random_tokens(CFG, 8, seed=5)
    lm_loss(reference(tokens), tokens).backward()
    options = dict(AOT)
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    fsdp_pass.set_gradient_divide_factor(model, 1.0)  # not sharded yet: recorded, applied when sharded
    compiled = torch.compile(model, backend="vescale", options=options)
    per_rank = 8 // world
    mine = tokens[rank * per_rank:(rank + 1) * per_rank]
    lm_loss(compiled(mine), mine).backward()
    kinds = (("compiled", world), ("eager", world), ("no_sync", 2 * world))[: 3 if mesh_shape is None else 2]
    worst = {kind: 0.0 for kind, _ in kinds}
    for kind, scale in kinds:
        for p, q in zip(model.parameters(), reference.parameters()):
            worst[kind] = max(worst[kind], _rel(p.grad.full_tensor(), scale * q.grad))
        model.zero_grad()
        if kind == "compiled":
            lm_loss(model(mine), mine).backward()
        elif kind == "eager" and len(kinds) == 3:  # two micro-batches, the first without sync: 2 x world gradients
            first, second = mine.chunk(2)
            with fsdp_pass.no_sync(model):
                lm_loss(compiled(first), first).backward()
            lm_loss(compiled(second), second).backward()
    assert max(worst.values()) <= TOLERANCE, worst
    # A factor changed after compiling would be ignored by the graph's constant: refused instead.
    fsdp_pass.set_gradient_divide_factor(model, 2.0)
    try:
        compiled(mine)
    except RuntimeError as e:
        assert "set_gradient_divide_factor before the first compiled call" in str(e), e
    else:
        raise AssertionError("a changed divide factor was not refused")
    return worst


def _no_sync_before_first_call(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = init_std(Llama(CFG))
    model = copy.deepcopy(reference)
    compiled = torch.compile(model, backend="vescale", options=AOT)
    per_rank = 8 // world
    micro = [random_tokens(CFG, 8, seed=s) for s in (7, 8)]
    with fsdp_pass.no_sync(compiled):  # the first call shards inside the block
        mine = micro[0][rank * per_rank:(rank + 1) * per_rank]
        lm_loss(compiled(mine), mine).backward()
        pending = [b.pending_bytes for b in buffers_of(model) if b.shard.requires_grad]
        assert all(n > 0 for n in pending), pending
        # reached, the sum not reduced yet: zero views until the flush ([Note: the gradient state of a parameter])
        assert all(p.grad is not None and not p.grad.full_tensor().any() for p in model.parameters())
    mine = micro[1][rank * per_rank:(rank + 1) * per_rank]
    lm_loss(compiled(mine), mine).backward()
    assert all(b.gradient_sync and b.pending_bytes == 0 for b in buffers_of(model))
    for tokens in micro:
        lm_loss(reference(tokens), tokens).backward()
    worst = max(_rel(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert worst <= TOLERANCE, worst
    return {"grad_rel": worst}


def _sharded_before_the_group(rank: int, world: int, init_file: str) -> None:
    model = MLP()
    fsdp_pass.fully_shard(model)  # no process group yet: a world of one
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for call in (lambda: torch.compile(model, backend="vescale", options=AOT)(torch.ones(2, 19)),
                 lambda: model(torch.ones(2, 19))):
        try:
            call()
        except RuntimeError as e:
            assert "was sharded over a single process" in str(e) and "init_process_group" in str(e), e
        else:
            raise AssertionError("a model sharded without a process group ran on several ranks")


def _state_dict_api(rank: int, world: int, tmp: str) -> dict:
    """torch's state-dict API with full_state_dict: whole tensors out (a plain model loads them) and in.

    Model and optimizer states go out of this world size's run into a file, and the next world size
    loads them ({2, 4} ranks, then one process in the test): the next steps continue bit-exactly.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_state_dict)

    torch._dynamo.reset()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    torch.manual_seed(0)
    model = init_std(Llama(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="vescale", options=AOT)
    incoming = os.path.join(tmp, f"from_{world // 2}.pt")
    per_rank = 8 // world

    def step(k: int) -> None:
        tokens = random_tokens(CFG, 8, seed=20 + k)[rank * per_rank:(rank + 1) * per_rank]
        lm_loss(compiled(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()

    if os.path.exists(incoming):  # the previous world size's state: in, and out again bit-exactly
        saved = torch.load(incoming)
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                       options=StateDictOptions(full_state_dict=True))
        model_sd, optim_sd = get_state_dict(model, opt, options=full)
        if rank == 0:
            for name, value in saved["model"].items():
                assert torch.equal(model_sd[name], value), f"{name} differs after loading {incoming}"
            for name, state in saved["optim"]["state"].items():
                for key, value in state.items():
                    assert torch.equal(optim_sd["state"][name][key], value), f"{name}.{key} differs"
    step(0)
    for sharded in (model.state_dict(), opt.state_dict()):  # what a rank-0 torch.save would write: refused
        try:
            torch.save(sharded, io.BytesIO())
        except RuntimeError as e:
            assert "cannot pickle (torch.save) a RaggedShardTensor sharded over" in str(e), e
        else:
            raise AssertionError("torch.save wrote this rank's pieces as if they were whole")
    model_sd, optim_sd = get_state_dict(model, opt, options=full)  # rank 0 keeps them (cpu_offload)
    # Inside unshard every parameter saves as its own tensor through storage-deduplicating savers.
    with fsdp_pass.unshard(model):
        if rank == 0:
            safetensors.torch.save_model(model, os.path.join(tmp, f"unshard_{world}.safetensors"))
    params = {name: p.full_tensor() for name, p in model.named_parameters()}  # collectives: every rank
    states = {name: {key: whole_tensor(v) if key != "step" else v for key, v in opt.state[p].items()}
              for name, p in model.named_parameters()}
    if rank != 0:
        assert model_sd == {}
        return {}
    plain = Llama(CFG)
    plain.load_state_dict(model_sd)  # strict: every key, whole tensors
    for name, q in plain.named_parameters():
        assert torch.equal(params[name], q), name
    from_safetensors = Llama(CFG)
    safetensors.torch.load_model(from_safetensors, os.path.join(tmp, f"unshard_{world}.safetensors"))
    for name, q in from_safetensors.named_parameters():
        assert torch.equal(params[name], q), name
    for name, p in model.named_parameters():
        for key, value in optim_sd["state"][name].items():
            assert torch.equal(value, states[name][key]), f"{name}.{key}"
            assert key == "step" or value.shape == p.shape, (name, key, value.shape)
    torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(tmp, f"from_{world}.pt"))
    return {"keys": len(model_sd)}


class FusedQKV(nn.Module):
    """A fused projection whose state dict holds q, k, v apart (torchtitan's FusedQKVLinear saves so)."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(16, 3 * 12, bias=False)
        self._register_state_dict_hook(_split_qkv_on_save)


def _split_qkv_on_save(module, state_dict, prefix, local_metadata) -> None:
    fused = state_dict.pop(prefix + "wqkv.weight")
    for name, part in zip("qkv", fused.chunk(3, dim=0)):
        state_dict[f"{prefix}w{name}.weight"] = part.view(2, 6, 16)  # heads x head_dim x dim


def _split_state_dict_hook(rank: int, world: int, tmp: str) -> None:
    """A state_dict hook that chunks and views a sharded parameter: DCP saves the parts, a plain load reads them."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(3)
    model = FusedQKV()
    whole = model.wqkv.weight.detach().clone()
    fsdp_pass.fully_shard(model)
    path = os.path.join(tmp, f"qkv_{world}")
    dcp.save(model.state_dict(), checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        plain = {f"w{n}.weight": torch.empty(2, 6, 16) for n in "qkv"}
        dcp.load(plain, checkpoint_id=path, no_dist=True)
        for name, part in zip("qkv", whole.chunk(3)):
            assert torch.equal(plain[f"w{name}.weight"], part.view(2, 6, 16)), name


def _blockwise_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """fsdp_pass's own optimizers, built before sharding: Muon on the hidden matrices, AdamW8bit (8-bit
    moments for the embedding, float32 for the norms) on the rest."""
    matrices, rest = muon_param_groups(model, exclude=("tok_embeddings", "output"))
    return [Muon([p for _, p in matrices], lr=0.02, ns_dtype=torch.float32),
            AdamW8bit([p for _, p in rest], lr=1e-2, block_size=32, min_8bit_size=64)]


def _blockwise_step(model: nn.Module, optimizers, rank: int, world: int, step: int) -> None:
    per_rank = 8 // world
    tokens = random_tokens(CFG, 8, seed=40 + step)[rank * per_rank:(rank + 1) * per_rank]
    lm_loss(model(tokens), tokens).backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _blockwise_state_dicts(rank: int, world: int, tmp: str) -> dict:
    """Muon and AdamW8bit through torch's state-dict API with full_state_dict: whole states keyed by
    parameter names. 2 ranks: save after 2 eager steps; a fresh model and optimizers load the file and
    step 3 equals the uninterrupted step 3 bit for bit. 4 ranks: load the 2-rank file (broadcast from
    rank 0) into another layout; the states read back equal the file's element by element, and step 3
    matches the 2-rank one (the test then loads the file on one process)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict, set_state_dict)

    def fresh() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        model = init_std(Llama(CFG))
        optimizers = _blockwise_optimizers(model)
        return fsdp_pass.fully_shard(model), optimizers

    def check_read_back(model, optimizers, saved) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizers, options=StateDictOptions(full_state_dict=True))
        assert model_sd.keys() == saved["model"].keys()
        assert all(torch.equal(model_sd[n], v) for n, v in saved["model"].items())
        assert optim_sd["state"].keys() == saved["optim"]["state"].keys()
        for name, state in saved["optim"]["state"].items():
            assert optim_sd["state"][name].keys() == state.keys(), name
            for key, value in state.items():
                got = optim_sd["state"][name][key]
                same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
                assert same and not isinstance(got, fsdp_pass.RaggedShardTensor), f"{name}.{key}"
        assert [g["ns_dtype"] for g in optim_sd["param_groups"] if "ns_dtype" in g] == ["float32"]

    path = os.path.join(tmp, "blockwise_from_2.pt")
    model, optimizers = fresh()
    if world == 2:
        for step in range(2):
            _blockwise_step(model, optimizers, rank, world, step)
        model_sd, optim_sd = get_state_dict(model, optimizers, options=StateDictOptions(full_state_dict=True))
        names = {n for n, _ in model.named_parameters()}
        assert set(optim_sd["state"]) == names, sorted(set(optim_sd["state"]) ^ names)  # keyed like torch's
        codes = optim_sd["state"]["tok_embeddings.weight"]
        assert codes["exp_avg"].dtype == torch.uint8 and codes["exp_avg_absmax"].shape == (CFG.vocab * CFG.dim // 32,)
        saved = {"model": model_sd, "optim": optim_sd}
        if rank == 0:
            torch.save(saved, path)
        _blockwise_step(model, optimizers, rank, world, 2)  # uninterrupted
        uninterrupted = {n: p.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(uninterrupted, os.path.join(tmp, "blockwise_step3.pt"))
        dist.barrier()
        model, optimizers = fresh()  # resumed at the same world size: bit for bit
        set_state_dict(model, optimizers, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                       options=StateDictOptions(full_state_dict=True))
        check_read_back(model, optimizers, saved)
        _blockwise_step(model, optimizers, rank, world, 2)
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), uninterrupted[name]), f"{name} differs after resuming"
        return {"resumed_equal": True}
    saved = torch.load(path)  # 4 ranks: another layout, rank 0's file broadcast
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # Separate calls: set_state_dict reads an empty model dict (the other ranks') as "optimizer only".
    set_model_state_dict(model, saved["model"] if rank == 0 else {}, options=broadcast)
    set_optimizer_state_dict(model, optimizers, saved["optim"] if rank == 0 else {}, options=broadcast)
    check_read_back(model, optimizers, saved)
    _blockwise_step(model, optimizers, rank, world, 2)
    uninterrupted = torch.load(os.path.join(tmp, "blockwise_step3.pt"))
    worst = max(_rel(p.full_tensor(), uninterrupted[n]) for n, p in model.named_parameters())
    assert worst <= TOLERANCE, worst
    return {"step3_rel_vs_2_ranks": worst}


class TinyTP(nn.Module):
    """A sequence-parallel norm (Replicate weight and bias), a column-parallel and a row-parallel
    linear (Replicate bias), and a plain head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 16)
        self.head = nn.Linear(16, 3)


def _tp_whole_tensors(rank: int, world: int) -> dict:
    """FSDP over TP (dp=2 x tp=2): full_tensor, redistribute to Replicate and the full state dict give
    whole tensors equal to one process's on every rank, ``Replicate()`` parameters included."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TinyTP()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], {"norm": SequenceParallel(), "up": ColwiseParallel(),
                                           "down": RowwiseParallel()})
    fsdp_pass.fully_shard(model, mesh, shard_dim="dp")
    replicated, empty = [], 0
    for name, p in model.named_parameters():
        assert is_sharded(p), name
        if isinstance(p, DTensor):
            if all(isinstance(pl, Replicate) for pl in p.placements):
                replicated.append(name)
                empty += p._local_tensor.to_local().numel() == 0
            assert p.to_local()._local is p._local_tensor._local, name  # to_local: the piece, no gather
            target = p.redistribute(p.device_mesh, [Replicate()] * p.device_mesh.ndim)
        else:
            target = p.redistribute(placements=[Replicate()])
        whole = p.full_tensor()
        assert type(whole) is torch.Tensor and torch.equal(whole, reference[name]), name
        assert torch.equal(target.to_local(), reference[name]), name
    assert sorted(replicated) == ["down.bias", "norm.bias", "norm.weight"], replicated
    full = StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(model, options=full)
    assert state.keys() == reference.keys()
    for name, value in state.items():
        assert type(value) is torch.Tensor and torch.equal(value, reference[name]), name
    other = {n: torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) for i, (n, v) in
             enumerate(reference.items())}
    set_model_state_dict(model, dict(other), options=full)  # torch puts the local values into the dict it gets
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), other[name]), name
    return {"replicated": len(replicated), "empty_replicated_pieces_here": empty}


def _save_pretrained_sharded(rank: int, world: int, tmp: str) -> dict:
    """Storage-based saving of a sharded Hugging Face model: refused with the fix, nothing written;
    after set_state_dict_type(model, "full") save_pretrained writes whole tensors from_pretrained reads."""
    import glob

    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    config = HFLlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    fsdp_pass.fully_shard(model)
    out = os.path.join(tmp, f"pretrained_{world}")
    calls = {"save_pretrained": lambda: model.save_pretrained(out),
             "safetensors": lambda: safetensors.torch.save_model(model, os.path.join(tmp, f"st_{rank}.safetensors")),
             "untyped_storage": model.model.norm.weight.untyped_storage,
             "storage of a state_dict value": lambda: model.state_dict()["model.norm.weight"].storage()}
    for what, call in calls.items():
        try:
            call()
        except RuntimeError as e:
            message = str(e)
            assert "is sharded" in message and "fsdp_pass.set_state_dict_type(model, 'full')" in message, (what, e)
            named = r"parameter 'model\.[\w.]+' is sharded \(shape \(\d+(, \d+)*,?\), RaggedShard"
            assert re.search(named, message), (what, e)
        else:
            raise AssertionError(f"{what} on a sharded model did not raise")
    dist.barrier()
    assert not glob.glob(os.path.join(out, "*.safetensors")) and not glob.glob(os.path.join(tmp, "st_*")), "shards"
    fsdp_pass.set_state_dict_type(model, "full")
    model.save_pretrained(out)  # every rank gathers; rank 0 writes
    fsdp_pass.set_state_dict_type(model, "sharded")
    dist.barrier()
    if rank == 0:
        loaded = LlamaForCausalLM.from_pretrained(out)
        for name, p in loaded.named_parameters():
            assert torch.equal(p, reference[name]), name
    return {"refused_then_saved_whole": True}


def _new_tensors_and_eager_checkpointing(rank: int, world: int) -> dict:
    """``p.new_empty(shape)`` + an init + ``copy_`` (torchtitan's fused-weight init) lands the one-process
    values; eager training through non-reentrant activation checkpointing (which saves ``p.detach()``
    and recomputes with it) matches one process."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = init_std(Llama(CFG))
    model = copy.deepcopy(reference)
    for m in (model, reference):
        for i, layer in enumerate(m.layers):
            m.layers[i] = checkpoint_wrapper(layer)
    fsdp_pass.fully_shard(model)
    with torch.device("meta"):
        uninitialized = Llama(CFG)  # new_* read neither the values nor the whole shape: no gather
    fsdp_pass.fully_shard(uninitialized, init="skip").to_empty(device="cpu")
    u = uninitialized.output.weight
    for made in (u.new_empty((3, 5)), u.new_zeros(4), u.new_ones((2, 2)), u.new_full((2,), 7.0),
                 u.new_empty_strided((2, 3), (1, 2))):
        assert type(made) is torch.Tensor and made.dtype == u.dtype, type(made)
    assert torch.equal(u.new_full((2,), 7.0), torch.full((2,), 7.0))
    p, q = model.output.weight, reference.output.weight
    for target in (p, q):
        whole = target.new_empty(target.shape)
        torch.manual_seed(3)
        nn.init.trunc_normal_(whole, std=0.02)
        with torch.no_grad():
            target.copy_(whole)
    assert torch.equal(p.full_tensor(), q)
    return _train_both(model, reference, rank, world, steps=0, eager_steps=2)


def _all_cases(rank: int, world: int, init_file: str, tmp: str) -> dict:
    _sharded_before_the_group(rank, world, init_file)
    torch._dynamo.reset()
    results = {
        "meta_flow": _meta_flow(rank, world),
        "state_dict_api": _state_dict_api(rank, world, tmp),
        "split_state_dict_hook": _split_state_dict_hook(rank, world, tmp),
    }
    results["blockwise_state_dicts"] = _blockwise_state_dicts(rank, world, tmp)
    if world == 2:  # training after the call: the 2-rank case; 4 ranks add HSDP
        results["to_after_sharding"] = _to_after_sharding(rank, world)
        results["divide_factor"] = _divide_factor(rank, world)
        results["no_sync_first"] = _no_sync_before_first_call(rank, world)
        results["save_pretrained"] = _save_pretrained_sharded(rank, world, tmp)
        results["new_tensors_and_checkpointing"] = _new_tensors_and_eager_checkpointing(rank, world)
    else:
        results["divide_factor_hsdp"] = _divide_factor(rank, world, mesh_shape=(2, 2))
        results["tp_whole_tensors"] = _tp_whole_tensors(rank, world)
    return results


def test_interop_cases_on_2_then_4_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 4):
            results = run_distributed(_all_cases, world, os.path.join(tmp, f"init{world}"), tmp, backend=None)
            print(world, results[0])
        saved = torch.load(os.path.join(tmp, "from_4.pt"))  # and into one process, unsharded
        plain = Llama(CFG)
        plain.load_state_dict(saved["model"])
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        names = [n for n, _ in plain.named_parameters()]
        opt.load_state_dict({"state": {i: saved["optim"]["state"][n] for i, n in enumerate(names)},
                             "param_groups": [{**saved["optim"]["param_groups"][0], "params": list(range(len(names)))}]})
        tokens = random_tokens(CFG, 8, seed=20)
        lm_loss(plain(tokens), tokens).backward()
        opt.step()  # one process continues from the 4-rank state
        _blockwise_on_one_process(tmp)


def _blockwise_on_one_process(tmp: str) -> None:
    """The 2-rank Muon + AdamW8bit state through torch's set_state_dict in one process (plain tensors,
    no process group): read back element by element, and step 3 matches the 2-rank run's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    saved = torch.load(os.path.join(tmp, "blockwise_from_2.pt"))
    torch.manual_seed(0)
    model = init_std(Llama(CFG))
    optimizers = _blockwise_optimizers(model)
    full = StateDictOptions(full_state_dict=True)
    set_state_dict(model, optimizers, model_state_dict=dict(saved["model"]), optim_state_dict=saved["optim"],
                   options=full)
    model_sd, optim_sd = get_state_dict(model, optimizers, options=full)
    assert all(torch.equal(model_sd[n], v) for n, v in saved["model"].items())
    for name, state in saved["optim"]["state"].items():
        for key, value in state.items():
            got = optim_sd["state"][name][key]
            assert (torch.equal(got, value) and got.dtype == value.dtype) if key != "step" else got == value, name
    _blockwise_step(model, optimizers, 0, 1, 2)
    uninterrupted = torch.load(os.path.join(tmp, "blockwise_step3.pt"))
    worst = max(_rel(p, uninterrupted[n]) for n, p in model.named_parameters())
    print("blockwise one process: step 3 rel vs 2 ranks", worst)
    assert worst <= TOLERANCE, worst
