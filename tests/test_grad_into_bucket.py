"""Weight gradients written straight into the bucket gradient ([Note: gradients written into the
bucket] in compile/passes/grad_into_bucket.py): no ``cat`` before the reduce-scatter, bitwise the same values."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_pass
from fsdp_pass.compile.backend import records
from fsdp_pass.compile.passes import pipeline
from fsdp_pass.compile.passes.grad_into_bucket import _in_place_producer
from fsdp_pass.tensor.ragged_tensor import bucket_of, is_sharded
from fsdp_pass.buckets.matmul_into import matmul_into
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss
from fsdp_pass.testing.spawn import run_distributed

_c10d = torch.ops._c10d_functional
# Dense blocks (mm weight gradients) and stacked experts computed by bmm, whose gradient is a
# transposed product (bmm → permute → clone before this pass).
CONFIGS = {
    "dense": LlamaConfig(layers=1),
    "experts": LlamaConfig(layers=1, experts=4, top_k=2, stacked_experts=True, batched_experts=True),
}


def test_matmul_into_writes_the_product_in_place():
    torch.manual_seed(0)
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    out = torch.full((40,), -1.0)
    matmul_into(out, 4, a, b, [], [])
    assert torch.equal(out[4:19].view(5, 3), torch.mm(a, b))
    assert torch.equal(out[:4], torch.full((4,), -1.0)) and torch.equal(out[19:], torch.full((21,), -1.0))
    a, b = torch.randn(2, 5, 7), torch.randn(2, 7, 3)
    matmul_into(out, 10, a, b, [2, 3, 5], [0, 2, 1])  # stored transposed, as a stacked weight's gradient
    # [Note: products written through a transposed target]: another BLAS kernel may run, so not bitwise
    torch.testing.assert_close(out[10:40].view(2, 3, 5), torch.bmm(a, b).permute(0, 2, 1).contiguous(),
                               rtol=TRANSPOSED_RTOL, atol=TRANSPOSED_ATOL)


# A product written through a transposed ``out=`` against the product then transposed: last-bit differences
# (MKL's AVX-512 mm sums in another order; its AVX2 kernels agree), nothing more.
TRANSPOSED_RTOL, TRANSPOSED_ATOL = 1e-6, 1e-6

# Chains from a product to a flat gradient segment, as autograd and Inductor's decompositions write
# them; each ends with the reshape to 1-D that the bucket's split backward produces.
CHAINS = {
    "as is": lambda p: p.reshape(-1),
    "t(t())": lambda p: p.t().t().reshape(-1),
    "transposed": lambda p: p.t().contiguous().reshape(-1),
    "transposed then reshaped": lambda p: p.t().contiguous().view(2, 2, 6).reshape(-1),
}


def _traced_producer(chain, a: torch.Tensor, b: torch.Tensor):
    """What the pass finds behind the segment ``chain(mm(a, b))`` of a traced ``cat``."""
    gm = make_fx(lambda a, b: torch.cat([chain(torch.mm(a, b))]))(a, b)
    (cat,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)
    return _in_place_producer(cat.args[0][0])


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_chains_from_a_product_are_written_in_place(chain):
    a, b = torch.randn(6, 5), torch.randn(5, 4)
    found = _traced_producer(CHAINS[chain], a, b)
    assert found is not None and found.matmul.target is torch.ops.aten.mm.default
    out = torch.zeros(24)
    matmul_into(out, 0, a, b, found.stored, found.dims)
    if found.dims:  # written through a transposed target: [Note: products written through a transposed target]
        torch.testing.assert_close(out, CHAINS[chain](torch.mm(a, b)), rtol=TRANSPOSED_RTOL, atol=TRANSPOSED_ATOL)
    else:  # the same kernel into a row-major target: bitwise
        assert torch.equal(out, CHAINS[chain](torch.mm(a, b)))


# Chains ``mm(..., out=)`` cannot write: the strided target would not be one matrix.
NOT_IN_PLACE = {
    "reshaped then transposed": lambda p: p.view(2, 3, 4).transpose(1, 2).contiguous().view(-1),
    "transposed, reshaped, transposed": lambda p: p.t().contiguous().view(8, 3).t().reshape(-1),
}


@pytest.mark.parametrize("chain", sorted(NOT_IN_PLACE))
def test_chains_out_of_reach_are_left_to_the_copy(chain):
    assert _traced_producer(NOT_IN_PLACE[chain], torch.randn(6, 5), torch.randn(5, 4)) is None


def _gradient_shards(config: LlamaConfig, compiler: str, rewrite: bool) -> tuple[list[torch.Tensor], dict]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = init_std(Llama(config))
    fsdp_pass.fully_shard(model, min_bucket_bytes=0)
    compiled = torch.compile(model, backend="vescale", options={"compiler": compiler})
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab, (2, 8), generator=g)
    if rewrite:
        lm_loss(compiled(tokens), tokens).backward()
    else:  # the reference: the same graphs with the pass left out
        with mock.patch.object(pipeline, "write_gradients_into_buckets", lambda gm, *a, **k: gm):
            lm_loss(compiled(tokens), tokens).backward()
    buffers = {id(bucket_of(p)[0]): bucket_of(p)[0] for p in model.parameters() if is_sharded(p)}
    backward = [r.modules[s] for r in records() for s in r.modules if s == "backward"][-1]
    copies = {n: why for b in buffers.values() for n, why in b.gradient_copies.items()}
    return [p.grad.clone() for p in model.parameters()], {"graph": backward, "copies": copies}


def _bitwise_and_no_cat(rank: int, world: int, compiler: str, names: tuple[str, ...]) -> None:
    for name in names:
        config = CONFIGS[name]
        reference, _ = _gradient_shards(config, compiler, rewrite=False)
        grads, found = _gradient_shards(config, compiler, rewrite=True)
        for i, (a, b) in enumerate(zip(grads, reference)):
            if name == "experts":  # stacked experts are written transposed: not bitwise on every CPU
                torch.testing.assert_close(a, b, rtol=TRANSPOSED_RTOL, atol=TRANSPOSED_ATOL,
                                           msg=lambda m: f"{name}: parameter {i} gradient: {m}")
            else:
                assert torch.equal(a, b), f"{name}: parameter {i} gradient differs by {(a - b).abs().max().item()}"
        graph = found["graph"].graph
        scatters = list(graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default))
        assert scatters, f"{name}: no reduce_scatter in the backward graph"
        cats = [s.args[0] for s in scatters if s.args[0].target is torch.ops.aten.cat.default]
        assert not cats, f"{name}: {len(cats)} reduce_scatter inputs are still a cat"
        writes = list(graph.find_nodes(op="call_function", target=matmul_into._opoverload))
        # one per block weight: wq wk wv wo + (w1 w2 w3, or the router and 3 stacked experts) per layer
        per_layer = 7 if name == "dense" else 8
        assert len(writes) == per_layer * config.layers, (name, len(writes))
        if name == "experts":
            assert any(w.args[5] for w in writes), "no stacked-expert gradient was written transposed"
        # What is still copied is named: the norm weights (reductions; every non-matmul under aot_eager).
        assert found["copies"] and all("norm" in n for n in found["copies"]), found["copies"]
        if compiler == "inductor":
            assert all("reduction" in why for why in found["copies"].values()), found["copies"]


# Under Inductor the experts model alone: its attention and router weights are the dense case.
@pytest.mark.parametrize("compiler, names", [("aot_eager", ("dense", "experts")), ("inductor", ("experts",))],
                         ids=["aot_eager", "inductor"])
def test_gradients_written_into_buckets_bitwise(compiler, names):
    run_distributed(_bitwise_and_no_cat, 2, compiler, names)


class _ConvThenLinear(torch.nn.Module):
    """A bucket with a gradient this pass cannot produce in place (the convolution's weight)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 3)
        self.proj = torch.nn.Linear(8 * 6, 5)

    def forward(self, x):
        return self.proj(self.conv(x).flatten(1))


def _fallback_still_matches(rank: int, world: int) -> None:
    grads = {}
    for rewrite in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _ConvThenLinear()
        compiled = torch.compile(model, backend="vescale", options={"compiler": "inductor"})
        x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(rank))
        if rewrite:
            compiled(x).square().sum().backward()
            text = str(fsdp_pass.explain(compiled, print_output=False))
        else:
            with mock.patch.object(pipeline, "write_gradients_into_buckets", lambda gm, *a, **k: gm):
                compiled(x).square().sum().backward()
        grads[rewrite] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)
    assert "conv.weight" in text and "extern kernel" in text, text


def test_gradient_that_cannot_be_written_in_place_is_copied_and_named():
    run_distributed(_fallback_still_matches, 2)
