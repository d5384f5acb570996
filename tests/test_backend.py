"""The vescale backend's compiled graphs, recompiles, model features and errors."""

from __future__ import annotations

import copy
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fsdp_pass
from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.compile.backend import records
from fsdp_pass.compile.passes.schedule import GATHER_CHAIN_OPS
from fsdp_pass.tensor.ragged_tensor import bucket_of
from fsdp_pass.testing.models import MLP, Llama, LlamaConfig, lm_loss

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release

_c10d = torch.ops._c10d_functional
_COPY_OPS = {torch.ops.aten.cat.default, torch.ops.aten.clone.default, torch.ops.aten.copy_.default,
             torch.ops.aten.copy.default, torch.ops.aten.split_with_sizes_copy.default}


def _count(gm: fx.GraphModule, op) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=op))


def _gathered(gm: fx.GraphModule, gathers: list[fx.Node] | None = None) -> set[fx.Node]:
    """Nodes holding (views of) a gathered bucket: all_gather outputs (``gathers``: these only) and their view chains."""
    out, stack = set(), list(gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)
                             if gathers is None else gathers)
    while stack:
        node = stack.pop()
        out.add(node)
        stack += [u for u in node.users if u.target in GATHER_CHAIN_OPS or getattr(u.target, "__name__", "") == "getitem"]
    return out


def _saved_for_backward(gm: fx.GraphModule) -> list[fx.Node]:
    (output,) = gm.graph.find_nodes(op="output")
    return [a for a in output.args[0][1:] if isinstance(a, fx.Node)]


def _structure_worker(rank: int, world: int, compiler: str) -> None:
    # The settings change the joint graph, which both compilers partition alike: Inductor runs the default only.
    settings = ((True, False), (True, True), (False, False)) if compiler == "aot_eager" else ((True, False),)
    for reshard, reshard_last in settings:
        torch._dynamo.reset()
        before = set(map(id, records()))
        torch.manual_seed(0)
        model = MLP()
        compiled = torch.compile(model, backend="vescale", options={"compiler": compiler, "reshard_after_forward": reshard,
                                                                   "reshard_last_bucket": reshard_last,
                                                                   "min_bucket_bytes": 0})
        compiled(torch.randn(4, 19)).sum().backward()
        (record,) = [r for r in records() if id(r) not in before]
        fw, bw = record.modules["forward"], record.modules["backward"]
        buckets = len(record.buffers)
        assert buckets == 3, record.buffers  # one per Linear (module units layers.0/1/2)
        assert _count(fw, _c10d.all_gather_into_tensor.default) == buckets
        assert _count(bw, _c10d.reduce_scatter_tensor.default) == buckets
        gathered = _gathered(fw)
        # Forward: parameters are views of the gathered buffers, no copy kernels in between.
        assert not any(n.target in _COPY_OPS for n in gathered), [n.name for n in gathered]
        saved_gathered = [n.name for n in _saved_for_backward(fw) if n in gathered]
        if reshard_last:
            assert saved_gathered == [], f"forward saves gathered buffers: {saved_gathered}"
            # Backward gathers again every bucket whose parameters it needs (not layer 0: x needs no grad).
            assert _count(bw, _c10d.all_gather_into_tensor.default) == buckets - 1
        elif reshard:
            # Only the last bucket stays gathered into backward ([Note: the last bucket stays gathered
            # into backward]); backward gathers again every other bucket whose parameters it needs (not
            # layer 0: x needs no grad).
            last = _gathered(fw, fw.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)[-1:])
            saved = {n for n in _saved_for_backward(fw) if n in gathered}
            assert saved and saved <= last, f"forward saves {saved_gathered}, not only the last bucket's views"
            assert _count(bw, _c10d.all_gather_into_tensor.default) == buckets - 2
        else:
            assert saved_gathered, "without reshard_after_forward the gathered views are kept for backward"
            assert _count(bw, _c10d.all_gather_into_tensor.default) == 0
        for p in model.parameters():
            assert isinstance(p.grad, fsdp_pass.RaggedShardTensor)
            buf, name = bucket_of(p)
            assert p.grad._local.untyped_storage().data_ptr() == buf.gradient_buffer().untyped_storage().data_ptr()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_collectives_views_and_saved_tensors(compiler):
    run_distributed(_structure_worker, 2, compiler)


def _recompile_worker(rank: int, world: int) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    calls = []
    for step in range(20):
        compiled(torch.randn(4, 19)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        calls.append(len(records()))
    assert calls[1] == calls[-1], f"backend calls per step: {calls}"
    # Each rank holds 1/m of parameters, gradients and optimizer state (plus padding).
    compiled(torch.randn(4, 19)).sum().backward()
    total = sum(p.numel() for p in model.parameters())
    local = torch.tensor(0)
    for p in model.parameters():
        n = p._local.numel()
        assert p.grad._local.numel() == n
        assert all(opt.state[p][k]._local.numel() == n for k in ("exp_avg", "exp_avg_sq"))
        local += n
    assert local.item() <= sum({id(b): b.layout.shard_size for b in (bucket_of(p)[0] for p in model.parameters())}.values())
    dist.all_reduce(local)
    assert local.item() == total
    opt.zero_grad()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    buffers = {id(bucket_of(p)[0]) for p in model.parameters()}
    shards = {bucket_of(p)[0].shard.data_ptr() for p in model.parameters()}
    compiled(torch.randn(6, 19)).sum().backward()  # a new batch size: recompiles ...
    assert len(records()) == calls[-1] + 1
    # ... but keeps the plan: same DBuffers, same storage.
    assert {id(bucket_of(p)[0]) for p in model.parameters()} == buffers
    assert {bucket_of(p)[0].shard.data_ptr() for p in model.parameters()} == shards


def test_no_recompiles_and_dynamic_batch_keeps_plan():
    run_distributed(_recompile_worker, 2)


class GraphBreakModel(nn.Module):
    """A graph break in the middle, a frozen layer, a buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.c = nn.Linear(16, 4)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x):
        x = F.relu(self.a(x)) * self.scale
        torch._dynamo.graph_break()
        x = F.relu(self.b(x)) + self.frozen(x)
        return self.c(x)


def _features_worker(rank: int, world: int) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GraphBreakModel()
    reference = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    per_rank = 8 // world
    for step in range(5):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        loss = compiled(x[rank * per_rank:(rank + 1) * per_rank]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), ref, rtol=1e-5, atol=1e-6, msg=name)
    assert model.frozen.weight.grad is None
    assert not isinstance(model.scale, fsdp_pass.RaggedShardTensor)
    # The same model called from a second compiled function (no_grad evaluation) reuses the layout.
    evaluate = torch.compile(lambda x: model(x).sum(), backend="vescale", options={"compiler": "aot_eager"})
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(evaluate(x), reference(x).sum(), rtol=1e-5, atol=1e-5)


def test_graph_break_frozen_buffer_and_second_compiled_function():
    run_distributed(_features_worker, 2)


def _mixed_precision_worker(rank: int, world: int) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig()
    model = Llama(cfg)
    reference = copy.deepcopy(model)
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    before = set(map(id, records()))
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager", "mp_policy": policy})
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=torch.Generator().manual_seed(1))
    loss = lm_loss(compiled(tokens[rank * 2:(rank + 1) * 2]), tokens[rank * 2:(rank + 1) * 2])
    loss.backward()
    (record,) = [r for r in records() if id(r) not in before]
    fw, bw = record.modules["forward"], record.modules["backward"]
    for node in fw.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        assert node.meta["val"].dtype == torch.bfloat16
    for node in bw.graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default):
        assert node.meta["val"].dtype == torch.float32
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
    reference_loss = lm_loss(reference(tokens), tokens)
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    # bf16 compute against an fp32 reference: bf16 has 8 mantissa bits.
    assert abs(global_loss.item() / world - reference_loss.item()) < 2e-2 * reference_loss.item()


def test_mixed_precision_gathers_bf16_and_reduces_fp32():
    run_distributed(_mixed_precision_worker, 2)


def _divergent_worker(rank: int, world: int) -> None:
    class Divergent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)) if rank == 0 else self.a(x)

    compiled = torch.compile(Divergent(), backend="vescale", options={"compiler": "aot_eager"})
    with pytest.raises(Exception, match="ranks disagree on the parameters"):
        compiled(torch.randn(2, 4))


def test_parameter_used_on_some_ranks_only_raises():
    run_distributed(_divergent_worker, 2)


def test_unknown_option_lists_valid_ones():
    compiled = torch.compile(nn.Linear(2, 2), backend="vescale", options={"bucket_sise": 10})
    with pytest.raises(Exception, match=r"unknown fsdp_pass option\(s\) \['bucket_sise'\].*bucket_size"):
        compiled(torch.randn(1, 2))


def test_in_place_write_to_parameter_in_forward_raises():
    class Mutating(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            with torch.no_grad():  # e.g. a weight renormalisation written inside forward
                self.w.mul_(0.5)
            return x * self.w

    torch._dynamo.reset()
    with pytest.raises(Exception, match="parameter 'w' .* modified in place"):
        torch.compile(Mutating(), backend="vescale", options={"compiler": "aot_eager"})(torch.randn(3))


def test_fake_process_group_plans_and_compiles_1024_ranks():
    from fsdp_pass.testing.fake_pg import fake_process_group

    torch._dynamo.reset()
    with fake_process_group(1024, rank=5):
        cfg = LlamaConfig(dim=64, ffn=128)
        model = Llama(cfg)
        total = sum(p.numel() for p in model.parameters())
        compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
        tokens = torch.randint(0, cfg.vocab, (2, cfg.seq))
        lm_loss(compiled(tokens), tokens).backward()
        buffers = {id(b): b for b in (bucket_of(p)[0] for p in model.parameters())}.values()
        assert all(b.mesh.shard_size == 1024 for b in buffers)
        per_rank = sum(b.layout.shard_size for b in buffers)
        padding = sum(b.layout.padding for b in buffers)
        assert per_rank * 1024 == total + padding
        for b in buffers:
            b.layout.validate()


def test_records_let_a_deleted_model_go():
    """explain()'s records refer to DBuffers weakly: deleting the model frees its shards."""
    import gc
    import weakref

    torch._dynamo.reset()
    model = MLP()
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    compiled(torch.randn(4, 19)).sum().backward()
    record = records()[-1]
    shard = weakref.ref(record.buffers[0].shard)
    assert record.alive and record.buffers
    del model, compiled
    torch._dynamo.reset()  # Dynamo's cache holds the compiled function, and it the buffers
    gc.collect()
    assert shard() is None, "a record kept the deleted model's shard alive"
    assert not record.alive and record not in records()


def _gradient_lifetime_worker(rank: int, world: int) -> None:
    import copy
    import weakref

    from fsdp_pass.testing.models import init_std

    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig()))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        tokens = torch.randint(0, 61, (2 * world, 8), generator=g)
        mine = tokens.chunk(world)[rank]
        loss = lm_loss(compiled(mine), mine)
        opt.zero_grad(set_to_none=True)  # between forward and backward: the last step's gradient must not leak in
        loss.backward()
        lm_loss(ref(tokens), tokens).backward()
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
    buf, _ = bucket_of(next(model.parameters()))
    shard_grad = weakref.ref(buf.gradient_buffer())
    assert buf.shard.grad is None  # only the parameters' .grad views hold it
    opt.zero_grad(set_to_none=True)
    assert shard_grad() is None, "zero_grad(set_to_none=True) must free the gradient shard at once"
    full = fsdp_pass.get_full_state_dict(model)
    if rank == 0:
        for name, p in ref.named_parameters():
            assert torch.allclose(full[name], p, rtol=1e-5, atol=1e-6), name


def test_zero_grad_frees_the_gradient_shard_at_once_and_between_forward_and_backward():
    run_distributed(_gradient_lifetime_worker, 2)


def test_inductor_keys_reach_inductor():
    """An Inductor key in options changes the code Inductor generates (size_asserts: the input checks)."""
    codes = {}
    for size_asserts in (True, False):
        torch._dynamo.reset()
        before = set(map(id, records()))
        model = nn.Linear(3, 2)
        torch.compile(model, backend="vescale", options={"size_asserts": size_asserts})(torch.randn(4, 3)).sum().backward()
        (record,) = [r for r in records() if id(r) not in before]
        codes[size_asserts] = record.graphs["forward (inductor code)"]
    calls = re.compile(r"^\s*assert_size_stride(_grouped)?\(", re.MULTILINE)  # 2.15 checks inputs in one grouped call
    assert calls.search(codes[True]) and not calls.search(codes[False])


def test_modes_and_inductor_keys_are_checked_as_torch_compile_checks_them():
    from torch._inductor import list_mode_options

    from fsdp_pass.options import Options

    assert Options.from_dict(None, "max-autotune-no-cudagraphs").inductor == list_mode_options("max-autotune-no-cudagraphs")
    mixed = Options.from_dict({"mode": "max-autotune-no-cudagraphs", "max_autotune": False, "prefetch": 2})
    assert mixed.prefetch == 2 and mixed.inductor["max_autotune"] is False  # explicit keys over the mode's, as torch's
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match=rf"mode='{mode}' turns on Inductor's CUDA graphs.*max-autotune-no-cudagraphs"):
            Options.from_dict(None, mode)
    with pytest.raises(ValueError, match=r"options\['triton.cudagraphs'\] turns on Inductor's CUDA graphs"):
        Options.from_dict({"triton.cudagraphs": True})
    with pytest.raises(ValueError, match=r"closest fsdp_pass options: none, closest Inductor keys: \['epilogue_fusion'"):
        Options.from_dict({"epilog_fusion": False})
    with pytest.raises(ValueError, match=r"closest fsdp_pass options: \['prefetch'\]"):
        Options.from_dict({"prefech": 1})
    with pytest.raises(ValueError, match="Inductor option 'epilogue_fusion' takes a bool"):
        Options.from_dict({"epilogue_fusion": 1})
    with pytest.raises(ValueError, match="have no effect with options\\['compiler'\\]='aot_eager'"):
        Options.from_dict({"compiler": "aot_eager", "epilogue_fusion": False})
    with pytest.raises(ValueError, match="is not a torch.compile mode"):
        Options.from_dict(None, "fastest")


_CUDA_GRAPHS_REFUSED = r"turns on Inductor's CUDA graphs, which fsdp_pass does not support.*max-autotune-no-cudagraphs"


def _refusal_of_compile(model: nn.Module, call=None) -> str:
    """The error the vescale backend (compiler Inductor) raises for ``model``'s first call (``call(compiled)``,
    default: one batch), Dynamo's wrapper taken off; the model must be left unsharded."""
    compiled = torch.compile(model, backend="vescale")
    with pytest.raises(Exception) as info:
        (call or (lambda c: c(torch.ones(4, 3))))(compiled)
    cause = getattr(info.value, "inner_exception", info.value)  # Dynamo wraps backend errors
    assert isinstance(cause, ValueError), f"{type(info.value).__name__}: {info.value}"
    assert not any(isinstance(p, fsdp_pass.RaggedShardTensor) for p in model.parameters()), "refused after sharding"
    return str(cause)


def test_cuda_graphs_are_refused_whatever_turns_them_on(four_fake_ranks):
    """Inductor's CUDA graphs turned on outside ``options`` (the global config, a ``config.patch`` around the
    call, Dynamo's ``override_cudagraphs``) get the refusal ``mode="reduce-overhead"`` gets, at the compile and
    before anything is sharded ([Note: no CUDA graphs around the collectives] in options.py)."""
    from torch._inductor import config

    with config.patch({"triton.cudagraphs": True}):  # set globally before the model is compiled
        message = _refusal_of_compile(nn.Linear(3, 2))
    assert re.search(r"^torch\._inductor\.config\.triton\.cudagraphs = True \(set in the config or by a config\.patch\) "
                     + _CUDA_GRAPHS_REFUSED, message), message

    def patched_call(compiled):
        with config.patch({"triton.cudagraphs": True}):  # only around the call that compiles
            compiled(torch.ones(4, 3))

    torch._dynamo.reset()
    assert re.search(r"config\.triton\.cudagraphs = True .*" + _CUDA_GRAPHS_REFUSED,
                     _refusal_of_compile(nn.Linear(3, 2), patched_call))
    assert not config.triton.cudagraphs

    torch._dynamo.reset()
    inner = nn.Linear(3, 2)

    class Annotated(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch._dynamo.override_cudagraphs(fwd=True):
                return self.inner(x)

    assert re.search(r"override_cudagraphs\(fwd=True\) around the compiled code " + _CUDA_GRAPHS_REFUSED,
                     _refusal_of_compile(Annotated()))
    assert not isinstance(inner.weight, fsdp_pass.RaggedShardTensor)


def test_cuda_graphs_check_reads_inductor_as_it_will_compile():
    """What the compile-time check lets through: CUDA graphs on in the config but off for this compile
    (``options["triton.cudagraphs"]=False``, ``override_cudagraphs(fwd=False)``, the aot_eager compiler); and
    the check where each graph goes to Inductor, so a variant compiled after the config changed is refused."""
    from torch._inductor import config
    from torch._inductor import _CudagraphAnnotation

    from fsdp_pass.compile.backend import CompiledGraph
    from fsdp_pass.compile.passes.pipeline import compile_scheduled
    from fsdp_pass.options import Options, check_cudagraphs_off

    with config.patch({"triton.cudagraphs": True}):
        check_cudagraphs_off(Options.from_dict({"triton.cudagraphs": False}), {})
        check_cudagraphs_off(Options.from_dict({"compiler": "aot_eager"}), {})
        check_cudagraphs_off(Options.from_dict(None), {"cudagraph_annotation": _CudagraphAnnotation(fwd=False, bwd=None)})
        with pytest.raises(ValueError, match=r"config\.triton\.cudagraphs = True .*" + _CUDA_GRAPHS_REFUSED):
            check_cudagraphs_off(Options.from_dict(None), {})
        with pytest.raises(ValueError, match=r"config\.triton\.cudagraphs = True .*" + _CUDA_GRAPHS_REFUSED):
            opts = Options.from_dict(None)
            compile_scheduled(fx.symbolic_trace(lambda x: x + 1), [torch.ones(2)], opts, CompiledGraph(opts))
    check_cudagraphs_off(Options.from_dict(None), {})


def test_cuda_graphs_from_the_environment_are_refused(tmp_path):
    """``TORCHINDUCTOR_CUDAGRAPHS=1`` sets ``torch._inductor.config.triton.cudagraphs`` when torch imports the
    config (torch/_inductor/config.py), so only a process started with it shows that the compile refuses it."""
    code = """
import torch, torch.nn as nn
import fsdp_pass
from fsdp_pass.testing.fake_pg import fake_process_group
with fake_process_group(2):
    try:
        torch.compile(nn.Linear(3, 2), backend="vescale")(torch.ones(4, 3))
    except Exception as error:
        print(getattr(error, "inner_exception", error))
"""
    env = {**os.environ, "TORCHINDUCTOR_CUDAGRAPHS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).resolve().parent.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"config\.triton\.cudagraphs = True \(TORCHINDUCTOR_CUDAGRAPHS=1 in the environment.*"
                     + _CUDA_GRAPHS_REFUSED, done.stdout), done.stdout + done.stderr[-3000:]
