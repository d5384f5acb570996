"""Block-quantized gradient reduction ([Note: block-quantized gradient reduction]): lossy by design, so it is
checked against error bounds, not parity; its convergence and bytes are measured by
benchmarks/quantized_reduce.py."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import fsdp_pass
from fsdp_pass.buckets.quantized_reduce import (
    INT8_MAX, ROUNDING_STREAM, dequantize_and_sum, quantize_for_reduce, sent_bytes,
)
from fsdp_pass.compile.backend import records
from fsdp_pass.options import Options, QuantizedReduce
from fsdp_pass.tensor import in_flight
from fsdp_pass.testing.collectives import quantized_exchanges_overlap
from fsdp_pass.testing.models import MLP, Llama, LlamaConfig, init_std, lm_loss
from fsdp_pass.testing.spawn import run_distributed


def _exchange(grads: list[torch.Tensor], block: int, stochastic: bool = False) -> list[torch.Tensor]:
    """What each rank gets from the all-to-all, done in one process: rank r sums row r of every rank's rows."""
    world = len(grads)
    rows = [quantize_for_reduce(g, world, block, stochastic) for g in grads]
    shard = grads[0].numel() // world
    return [dequantize_and_sum(torch.stack([r[dest] for r in rows]), shard, block) for dest in range(world)]


def test_round_to_nearest_is_within_half_a_step_of_every_block():
    torch.manual_seed(0)
    world, shard, block = 4, 300, 64  # 300 is no multiple of 64: each rank's last block is padded
    grads = [torch.randn(world * shard) * torch.logspace(-3, 2, world * shard) for _ in range(world)]
    exact = torch.stack(grads).sum(0)
    for dest, got in enumerate(_exchange(grads, block)):
        # each source's error on an element is at most half its block's step, absmax / 127 / 2
        bound = torch.zeros(shard)
        for g in grads:
            part = torch.nn.functional.pad(g[dest * shard:(dest + 1) * shard], (0, -shard % block))
            step = part.view(-1, block).abs().amax(1, keepdim=True) / INT8_MAX
            bound += (step / 2).expand(-1, block).reshape(-1)[:shard]
        err = (got - exact[dest * shard:(dest + 1) * shard]).abs()
        assert (err <= bound * (1 + 1e-5) + 1e-12).all(), f"rank {dest}: error above half a step"
        assert err.max() > 0  # lossy: the test would notice an exact path


def test_no_block_spans_a_rank_boundary():
    """Rank 0's part is tiny, rank 1's huge: a block across the boundary would round rank 0's part to 0."""
    world, shard = 2, 96  # blocks of 64: the boundary at 96 is inside the second block of a shared grid
    g = torch.cat([torch.full((shard,), 1e-4), torch.full((shard,), 1e4)]) * torch.linspace(0.5, 1.0, world * shard)
    zero = torch.zeros_like(g)
    got = _exchange([g, zero], block=64)
    assert torch.allclose(got[0], g[:shard], rtol=1e-2)
    assert torch.allclose(got[1], g[shard:], rtol=1e-2)


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    g = torch.rand(2 * 128) * 0.5 + torch.linspace(-1, 1, 2 * 128)
    mean = torch.stack([_exchange([g, torch.zeros_like(g)], 128, stochastic=True)[0] for _ in range(2000)]).mean(0)
    step = g[:128].abs().max() / INT8_MAX
    assert (mean - g[:128]).abs().max() < 0.1 * step  # 2000 draws: the mean's std is ~0.011 step


def test_bytes_are_a_quarter_of_fp32_plus_the_scales():
    world, shard = 8, 128 * 1000
    assert sent_bytes(world, shard, 128) / ((world - 1) * shard * 4) == pytest.approx(0.25 + 1 / 128)


@pytest.mark.parametrize("value,match", [
    ({"bits": 4}, r"only 8 \(int8 codes\) is implemented"),
    ({"block": 0}, r"\['block'\] must be a positive number"),
    ({"rounding": "up"}, r"\['rounding'\] is 'up'; use 'nearest' or 'stochastic'"),
    ({"tile": 8}, r"unknown options\['quantized_reduce'\] key\(s\) \['tile'\]"),
    ("int8", r"use True or a dict"),
])
def test_bad_options_are_refused(value, match):
    with pytest.raises(ValueError, match=match):
        Options.from_dict({"quantized_reduce": value})
    assert Options.from_dict({"quantized_reduce": True}).quantized_reduce == QuantizedReduce(128, False)


def _reduced(rank: int, world: int, options: dict, micro: int, mesh_shape: tuple[int, ...] | None = None,
             frozen: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """Whole gradients after one step (``micro`` micro-batches, the first ones under no_sync), and explain()'s
    plan; ``frozen``: a block whose parameters train not (a bucket without gradients)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    ROUNDING_STREAM.reset()
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig(layers=1)))
    if frozen:
        model.get_submodule(frozen).requires_grad_(False)
    compiled = torch.compile(model, backend="vescale", options={
        "mesh": init_device_mesh("cpu", mesh_shape or (world,)), "compiler": "aot_eager", **options})
    for step in range(2):  # step 0 shards; step 1 accumulates under no_sync
        tokens = torch.randint(0, 61, (8, 8), generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
        for i, part in enumerate(tokens.chunk(micro)):
            sync = contextlib.nullcontext() if i == micro - 1 or step == 0 else fsdp_pass.no_sync(compiled)
            with sync:
                (lm_loss(compiled(part), part) / micro).backward()
        in_flight.settle_all()
        if step == 0:
            model.zero_grad()  # None: the deferred reduce may leave the next one in flight
    plan = fsdp_pass.explain(compiled, print_output=False).plan_text()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}, plan


def _relative_errors(got: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict[str, float]:
    assert got.keys() == exact.keys()
    return {name: ((got[name] - g).norm() / g.norm()).item() for name, g in exact.items()}


def _backward_code() -> str:
    return "\n".join(code for stage, code in records()[-1].graphs.items() if stage.startswith("backward"))


def _dropout_masks(rank: int, world: int, quantized: dict | None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """An MLP trained 3 steps with dropout on its input (the user's RNG stream): each step's mask, and the
    global generator's state at the end."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    torch.manual_seed(0)  # every rank alike, as training recipes seed
    model = MLP()
    options = {"mesh": init_device_mesh("cpu", (world,)), "compiler": "aot_eager", "min_bucket_bytes": 0}
    compiled = torch.compile(model, backend="vescale", options={**options, "quantized_reduce": quantized}
                             if quantized else options)
    masks = []
    for step in range(3):
        x = torch.randn(8, 19, generator=torch.Generator().manual_seed(step)).chunk(world)[rank] + 3
        dropped = torch.nn.functional.dropout(x, 0.5)
        masks.append(dropped != 0)
        compiled(dropped).square().mean().backward()
        in_flight.settle_all()
        model.zero_grad()
    return masks, torch.get_rng_state()


def _compiled_cases(rank: int, world: int) -> None:
    q = {"quantized_reduce": {"block": 32}, "min_bucket_bytes": 0}  # a bucket per unit: several buckets
    bound = 0.02  # int8 with a scale per 32 elements: per element at most 1/254 of its block's absmax per rank
    exact, _ = _reduced(rank, world, {}, micro=1)

    quantized, plan = _reduced(rank, world, q, micro=1)
    assert all(0 < rel < bound for rel in _relative_errors(quantized, exact).values()), _relative_errors(quantized, exact)
    graphs = _backward_code()
    assert "all_to_all_single" in graphs and "reduce_scatter" not in graphs
    assert re.search(r"gradient reduce-scatter of bucket \d+: int8 codes \+ 1 float32 scale per 32 elements", plan), plan
    # each bucket's exchange is in flight until the next bucket's gradient is computed and quantized
    assert quantized_exchanges_overlap(records()[-1].modules["backward"].graph), "a quantized exchange waits at once"
    # the last reduce left to the optimizer step is quantized too (it reduces at once, not in flight)
    deferred, _ = _reduced(rank, world, {**q, "overlap_last_reduce": True}, micro=1)
    assert all(torch.equal(deferred[name], g) for name, g in quantized.items())

    # no_sync: two micro-batches, the first accumulated unreduced; the last flush is quantized: against the
    # exact flush of the same accumulation it errs as a quantized step does (an exact flush: ~1e-7)
    exact_accumulated, _ = _reduced(rank, world, {}, micro=2)
    accumulated, _ = _reduced(rank, world, q, micro=2)
    errors = _relative_errors(accumulated, exact_accumulated)
    assert all(1e-3 < rel < bound for rel in errors.values()), errors

    # HSDP (replicate 2 x shard 2): quantized within each replica group, then the replicas' exact all-reduce
    hsdp, _ = _reduced(rank, world, q, micro=1, mesh_shape=(2, world // 2))
    assert all(0 < rel < bound for rel in _relative_errors(hsdp, exact).values()), _relative_errors(hsdp, exact)
    graphs = _backward_code()
    assert "all_to_all_single" in graphs and "all_reduce" in graphs and "reduce_scatter" not in graphs

    # a frozen block: its bucket has no gradient to reduce, the others are reduced quantized
    frozen, _ = _reduced(rank, world, q, micro=1, frozen="layers.0")
    assert frozen and not any(name.startswith("layers.0.") for name in frozen)
    errors = _relative_errors(frozen, {name: g for name, g in exact.items() if name in frozen})
    assert all(0 < rel < bound for rel in errors.values()), errors

    # stochastic rounding: the user's random stream is untouched (dropout masks and the generator's state
    # match the run without the option), and the rounding noise differs from rank to rank
    plain_masks, plain_state = _dropout_masks(rank, world, None)
    masks, state = _dropout_masks(rank, world, {"block": 32, "rounding": "stochastic"})
    assert all(torch.equal(a, b) for a, b in zip(masks, plain_masks)) and torch.equal(state, plain_state)
    draws = [None] * world
    torch.distributed.all_gather_object(draws, torch.rand(4, generator=ROUNDING_STREAM.generator(torch.device("cpu"))))
    assert all(not torch.equal(draws[0], d) for d in draws[1:]), "ranks round with the same random numbers"

    # a non-finite gradient stays non-finite through the quantized reduction, and clip_grad_norm_ sees it
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig(layers=1)))
    compiled = torch.compile(model, backend="vescale", options={
        "mesh": init_device_mesh("cpu", (world,)), "compiler": "aot_eager", **q})
    tokens = torch.randint(0, 61, (world, 8), generator=torch.Generator().manual_seed(0))[rank:rank + 1]
    poison = float("inf") if rank == 1 else 1.0  # one rank's loss overflows: its gradients are inf or nan
    (lm_loss(compiled(tokens), tokens) * poison).backward()
    in_flight.settle_all()
    assert all(not torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert not torch.isfinite(norm), f"clip_grad_norm_ returned {norm} for non-finite gradients"


@pytest.mark.slow
def test_compiled_llama_reduces_within_the_error_bound_no_sync_hsdp_frozen_dropout_and_nan():
    run_distributed(_compiled_cases, 4)


def test_a_nan_or_inf_stays_non_finite_in_its_block_only():
    world, shard, block = 2, 64, 32
    grads = [torch.randn(world * shard) for _ in range(world)]
    grads[1][5] = float("nan")  # rank 0's part, first block
    grads[0][shard + 40] = float("inf")  # rank 1's part, second block
    got = _exchange(grads, block)
    exact = torch.stack(grads).sum(0)
    assert not torch.isfinite(got[0][5]) and not torch.isfinite(got[1][40])  # the poisoned elements
    for dest, finite in ((0, slice(block, shard)), (1, slice(0, block))):  # the other blocks: within the bound
        part = exact[dest * shard:(dest + 1) * shard][finite]
        assert torch.isfinite(got[dest][finite]).all()
        assert ((got[dest][finite] - part).norm() / part.norm()) < 0.02
