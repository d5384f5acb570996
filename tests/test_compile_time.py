"""Compile time: repeated blocks compiled once ([Note: repeated blocks compiled once]) train like the
flat graph, with the same collectives and gathers recomputed in backward, and blocks that differ stay
flat; ranks on a shared cache compile in turn ([Note: ranks compile a graph once between them]) and a
second compile loads AOTAutograd's output only for the settings that made it ([Note: AOTAutograd's
output cached with the backend's settings in its key])."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

import fsdp_pass
from fsdp_pass.compile.backend import records
from fsdp_pass.compile.shared_cache import compile_in_turn
from fsdp_pass.testing.models import MLP, Block, Llama, LlamaConfig, lm_loss, random_tokens
from fsdp_pass.testing.spawn import run_distributed

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release

_c10d = torch.ops._c10d_functional
_INVOKE = torch.ops.higher_order.invoke_subgraph


def _count(gm: fx.GraphModule, op) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=op))


def _llama_loss(compiled: nn.Module, model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    tokens = random_tokens(model.cfg, 2 * world, step)[2 * rank:2 * rank + 2]
    return lm_loss(compiled(tokens), tokens)


def _mlp_loss(compiled: nn.Module, model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    inputs = torch.randn(2 * world, 19, generator=torch.Generator().manual_seed(step))[2 * rank:2 * rank + 2]
    return compiled(inputs).square().mean()


def _train(model: nn.Module, options: dict, rank: int, world: int, steps: int = 2,
           loss_of=_llama_loss) -> tuple[list, list, dict]:
    """Losses, final parameters and the first new compile record of ``steps`` steps of ``model``."""
    torch._dynamo.reset()
    before = set(map(id, records()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="vescale", options=options)
    losses = []
    for step in range(steps):
        loss = loss_of(compiled, model, step, rank, world)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    record = next(r for r in records() if id(r) not in before)
    text = fsdp_pass.explain(model, print_output=False).plan_text()
    return losses, params, {"record": record, "explain": text}


def _same_as_flat_worker(rank: int, world: int) -> None:
    _compile_in_turn(rank, world)
    cfg = LlamaConfig(layers=3)
    # min_bucket_bytes=0: a bucket per layer, which its block takes whole (_differing_worker: one bucket, views).
    for extra in ({"min_bucket_bytes": 0},):
        runs = {}
        for once in (True, False):
            torch.manual_seed(0)
            runs[once] = _train(Llama(cfg), {"compiler": "aot_eager", "compile_blocks_once": once, **extra}, rank, world)
        (l1, p1, o), (l0, p0, f) = runs[True], runs[False]
        assert all(torch.equal(a, b) for a, b in zip(l1, l0)), (extra, l1, l0)
        assert all(torch.equal(a, b) for a, b in zip(p1, p0)), extra
        assert "layers.0, layers.1, layers.2 call one subgraph (fsdp_block_0, 3 calls)" in o["explain"], o["explain"]
        assert "compiled once" not in f["explain"]
        outlined, flat = o["record"].modules, f["record"].modules
        assert _count(outlined["forward"], _INVOKE) == 3 and _count(outlined["backward"], _INVOKE) == 3
        for stage in ("forward", "backward"):  # the same collectives: backward still gathers again
            for op in (_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default):
                assert _count(outlined[stage], op) == _count(flat[stage], op), (extra, stage, op)
        assert _count(outlined["backward"], _c10d.all_gather_into_tensor.default) >= 1
        if extra:  # whole buckets: no per-layer cat feeds a reduce-scatter, the matmuls write into the bucket
            cats = [n for n in outlined["backward"].graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)
                    if any(u.target is _c10d.reduce_scatter_tensor.default for u in n.users)]
            assert not cats


class _Odd(Block):
    """A block with one more op than the plain ones."""

    def forward(self, x, freqs):
        return super().forward(x, freqs) * 0.5


class _Odder(Block):
    """A block like no other."""

    def forward(self, x, freqs):
        return super().forward(x, freqs) * 0.25 + 1.0


def _differing_worker(rank: int, world: int) -> None:
    """Three plain blocks share a subgraph; two alike odd ones stay flat (shared from three), as does one
    like no other; training is bitwise the flat graph's."""
    cfg = LlamaConfig(layers=6)
    runs = {}
    for once in (True, False):
        torch.manual_seed(0)
        model = Llama(cfg)
        for i, kind in ((2, _Odd), (4, _Odd), (5, _Odder)):
            odd = kind(cfg)
            odd.load_state_dict(model.layers[i].state_dict())
            model.layers[i] = odd
        runs[once] = _train(model, {"compiler": "aot_eager", "compile_blocks_once": once}, rank, world)
    (l1, p1, o), (l0, p0, _) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(l1, l0)) and all(torch.equal(a, b) for a, b in zip(p1, p0))
    assert "layers.0, layers.1, layers.3 call one subgraph (fsdp_block_0, 3 calls)" in o["explain"], o["explain"]
    for block in ("layers.2", "layers.4"):
        assert f"block left flat: {block} (2 alike; shared from 3)" in o["explain"], o["explain"]
    assert "block left flat: layers.5 (matches no other block)" in o["explain"], o["explain"]


def _aot_cache_counts() -> dict:
    return dict(torch._dynamo.utils.counters["aot_autograd"])


def _warm_start_worker(rank: int, world: int, cache: str) -> None:
    """With ``shared_compile_cache`` a second compile of the same model and options (a warm start: Dynamo
    reset, the cache folder kept) loads AOTAutograd's and Inductor's output and trains bitwise the same;
    other options, which torch's own cache key does not see, trace anew."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # one folder for both ranks, empty at first
    shared = {"compiler": "inductor", "shared_compile_cache": True}
    runs = []
    # A bound no bucket reaches: the same schedule (Inductor's cache has its graphs), but other options.
    for options in (shared, shared, {**shared, "max_inflight_bytes": 1 << 40}):
        before = _aot_cache_counts()
        torch.manual_seed(0)
        losses, params, o = _train(MLP(), options, rank, world, loss_of=_mlp_loss)  # few kernels to build
        after = _aot_cache_counts()
        runs.append((losses, params, o["record"].graphs,
                     {k: after.get(k, 0) - before.get(k, 0) for k in ("autograd_cache_hit", "autograd_cache_miss")}))
    (l_cold, p_cold, g_cold, n_cold), (l_warm, p_warm, g_warm, n_warm), (l_other, p_other, g_other, n_other) = runs
    compiled, loaded = {"autograd_cache_hit": 0, "autograd_cache_miss": 1}, {"autograd_cache_hit": 1, "autograd_cache_miss": 0}
    # Rank 0 compiles each graph; the other ranks, compiling after it, load it ([Note: ranks compile a graph once between them]).
    assert [n_cold, n_warm, n_other] == ([compiled, loaded, compiled] if rank == 0 else [loaded] * 3), (n_cold, n_warm, n_other)
    for graphs, made in ((g_cold, rank == 0), (g_warm, False), (g_other, rank == 0)):
        assert ("forward" in graphs) == made, list(graphs)
        assert made or "loaded from torch's compile cache" in graphs["compiled stages"], list(graphs)
    for losses, params in ((l_warm, p_warm), (l_other, p_other)):
        assert all(torch.equal(a, b) for a, b in zip(l_cold, losses)) and all(torch.equal(a, b) for a, b in zip(p_cold, params))


def _cases(rank: int, world: int, cache: str) -> None:
    _same_as_flat_worker(rank, world)
    _differing_worker(rank, world)
    _warm_start_worker(rank, world, cache)


def test_blocks_compiled_once_train_bitwise_as_the_flat_graph_blocks_that_differ_stay_flat_and_say_why():
    """One process group: the compile turn, blocks compiled once against flat, differing blocks, a warm start."""
    with tempfile.TemporaryDirectory() as cache:
        run_distributed(_cases, 2, cache)


def _compile_in_turn(rank: int, world: int) -> None:
    """[Note: ranks compile a graph once between them]: the others start once rank 0 is done."""
    with compile_in_turn(True):
        start = time.monotonic()
        assert torch._functorch.config.force_non_lazy_backward_lowering  # backward compiled in the turn too
        if rank == 0:
            time.sleep(1.0)
        end = time.monotonic()
    spans = [None] * world
    dist.all_gather_object(spans, (start, end))
    assert all(spans[r][0] >= spans[0][1] for r in range(1, world)), spans
    assert not torch._functorch.config.force_non_lazy_backward_lowering
    with compile_in_turn(False):
        assert not torch._functorch.config.force_non_lazy_backward_lowering


def test_explain_names_blocks_without_the_traced_frame_local():
    """``explain()`` names a block by its module path however the model reached the graph (``self`` or an argument)."""
    from fsdp_pass.compile.passes.outline import Outlined

    lines = Outlined(shared={"fsdp_block_0": ["L['self'].layers.1", "L['self'].layers.2", "L['self'].layers.3"]},
                     left_flat={"L['args'][0].model.layers.0": "2 alike; shared from 3"}).lines()
    assert lines == ["repeated blocks compiled once: layers.1, layers.2, layers.3 call one subgraph (fsdp_block_0, 3 calls)",
                     "block left flat: model.layers.0 (2 alike; shared from 3)"], lines
