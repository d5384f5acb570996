"""Gradient accumulation without a reduce-scatter per micro-batch: ``fsdp_pass.no_sync`` /
``fsdp_pass.set_requires_gradient_sync`` (see [Note: gradient accumulation without sync])."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_pass
from fsdp_pass.compile.backend import records
from fsdp_pass.buckets.dbuffer import DBuffer
from fsdp_pass.tensor.ragged_tensor import bucket_of, is_sharded

# The shared test helpers, imported in this one place.
from fsdp_pass.testing.collectives import CountCollectives
from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss

TOLERANCE = 1e-5  # fp32, relative
MICRO_BATCHES = 4
STEPS = 2
PER_MICRO = 2  # sequences per rank per micro-batch


def _buffers(model: nn.Module) -> list[DBuffer]:
    found = {}
    for p in model.parameters():
        if is_sharded(p):
            buf, _ = bucket_of(p)
            found[id(buf)] = buf
    return list(found.values())


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _batch(step: int, global_batch: int, seq: int = 8, vocab: int = 61) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, vocab, (global_batch, seq), generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _accumulate(rank: int, world: int, options: dict, layers: int = 2, mesh_shape=None) -> dict:
    """Train STEPS steps of MICRO_BATCHES micro-batches (all but the last in no_sync) against one
    process on the same global batch; assert parity and one reduce-scatter per trainable bucket per step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig(layers=layers)))
    reference = copy.deepcopy(model)
    mesh = None
    if mesh_shape is not None:  # HSDP: (replicate, shard)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape)
        options = {**options, "mesh": mesh}
    fsdp_pass.fully_shard(model, mesh, min_bucket_bytes=0)  # a bucket per block: several buckets to count
    graphs_before = _unique_graphs()
    compiled = torch.compile(model, backend="vescale", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    trainable = [b for b in _buffers(model) if b.shard.requires_grad]
    shard_world = world if mesh_shape is None else mesh_shape[-1]
    expected_pending = sum(b.shard.numel() * shard_world * 4 for b in trainable)
    # Compile both graphs first (the profiler would also count the collectives traced while compiling);
    # no optimizer step, so training below starts from the same parameters as the reference.
    x = _batch(99, PER_MICRO)
    with fsdp_pass.no_sync(compiled):
        lm_loss(compiled(x), x).backward()
    lm_loss(compiled(x), x).backward()
    opt.zero_grad()
    worst_loss, pending_bytes, scatters = 0.0, 0, []
    for step in range(STEPS):
        tokens = _batch(step, world * MICRO_BATCHES * PER_MICRO)
        total = torch.zeros(())
        step_scatters = []
        for micro in range(MICRO_BATCHES):
            lo = (micro * world + rank) * PER_MICRO
            x = tokens[lo : lo + PER_MICRO]
            last = micro == MICRO_BATCHES - 1
            with CountCollectives() as counter, (fsdp_pass.no_sync(compiled) if not last else torch.enable_grad()):
                loss = lm_loss(compiled(x), x) / MICRO_BATCHES
                loss.backward()
            total += loss.detach()
            step_scatters.append(counter.counts["reduce_scatter_tensor"])
            if not last:
                pending_bytes = max(pending_bytes, sum(b.pending_bytes for b in trainable))
        assert sum(b.pending_bytes for b in trainable) == 0, "the accumulated gradient was not freed"
        # None while accumulating, then one per trainable bucket.
        assert step_scatters == [0] * (MICRO_BATCHES - 1) + [len(trainable)], (step, step_scatters, len(trainable))
        scatters.append(sum(step_scatters))
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(reference(tokens), tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        dist.all_reduce(total)
        total /= world
        worst_loss = max(worst_loss, abs(total.item() - ref_loss.item()) / abs(ref_loss.item()))
    ref_params = dict(reference.named_parameters())
    worst_param = max(_rel(p.full_tensor().detach(), ref_params[n].detach()) for n, p in model.named_parameters())
    assert worst_loss <= TOLERANCE and worst_param <= TOLERANCE, (worst_loss, worst_param)
    assert pending_bytes == expected_pending, (pending_bytes, expected_pending)
    # One Dynamo graph; the accumulating variant compiled once, not per switch.
    assert _unique_graphs() - graphs_before == 1
    ours = [r for r in records() if any(b in trainable for b in r.buffers)]
    assert [sum(s.endswith("(accumulate)") for s in r.graphs) for r in ours] == [2], [list(r.graphs) for r in ours]
    return {
        "loss_rel": worst_loss, "param_rel": worst_param, "reduce_scatters_per_step": scatters,
        "trainable_buckets": len(trainable), "pending_bytes": pending_bytes,
        "shard_bytes": sum(b.shard.numel() * 4 for b in trainable),
        "param_bytes": sum(p.numel() * 4 for p in ref_params.values()),
    }


def _run(rank: int, world: int, cases: list[dict], layers: int = 2, mesh_shape=None) -> None:
    for options in cases:
        result = _accumulate(rank, world, options, layers, mesh_shape)
        if rank == 0:
            print(f"no_sync {options}: {result}")


def test_no_sync_parity_aot_eager():
    run_distributed(_run, 2, [{"compiler": "aot_eager"}, {"compiler": "aot_eager", "reshard_after_forward": False}])


@pytest.mark.slow
def test_no_sync_parity_inductor():
    run_distributed(_run, 2, [{"compiler": "inductor"}], 1)  # one block: Inductor compiles are the slow part


@pytest.mark.slow
def test_no_sync_parity_hsdp_2x2():
    """The flush all-reduces over the replicate dim too: still one reduce-scatter per bucket."""
    run_distributed(_run, 4, [{"compiler": "aot_eager"}], 1, (2, 2))


# -- in one process: compile counts and bad input --------------------------------------------------


def _sharded_llama():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig(layers=1)))
    fsdp_pass.fully_shard(model)
    return model


def test_switching_compiles_each_graph_once():
    model = _sharded_llama()
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    before, graphs_before = set(map(id, records())), _unique_graphs()
    x = _batch(0, 2)
    for sync_steps, no_sync_steps in [(1, 0), (0, 2), (1, 0), (1, 0), (0, 1), (1, 0), (0, 3), (2, 0)]:
        for _ in range(no_sync_steps):
            with fsdp_pass.no_sync(compiled):
                lm_loss(compiled(x), x).backward()
        for _ in range(sync_steps):
            lm_loss(compiled(x), x).backward()
    assert _unique_graphs() - graphs_before == 1
    (record,) = [r for r in records() if id(r) not in before]
    stages = [s for s in record.graphs if s.startswith(("forward", "backward"))]
    assert sorted(stages) == ["backward", "backward (accumulate)", "forward", "forward (accumulate)"], stages
    assert all(b.pending_bytes == 0 for b in _buffers(model))


def test_settings_on_a_model_not_sharded_yet_wait_for_its_buckets():
    """[Note: settings recorded before sharding]; tests/test_interop.py trains through it on 2 and 4 ranks."""
    from fsdp_pass.buckets.settings import recorded

    model = Llama(LlamaConfig(layers=1))
    for target in (model, torch.compile(model, backend="vescale")):  # compiled but never run: not sharded yet
        with fsdp_pass.no_sync(target):
            assert all(recorded(p, "gradient_sync") is False for p in model.parameters())
        assert all(recorded(p, "gradient_sync") is True for p in model.parameters())
        with pytest.raises(ValueError, match="backend='vescale'"):
            fsdp_pass.reduce_gradients(target)  # nothing can be pending before sharding
    with pytest.raises(ValueError, match="set_requires_gradient_sync: ReLU has no parameters"):
        fsdp_pass.set_requires_gradient_sync(torch.nn.ReLU(), False)


def test_state_is_restored_on_error_and_nesting():
    model = _sharded_llama()
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    buffers = _buffers(model)
    with pytest.raises(RuntimeError, match="boom"):
        with fsdp_pass.no_sync(compiled):
            assert not any(b.gradient_sync for b in buffers)
            raise RuntimeError("boom")
    assert all(b.gradient_sync for b in buffers)
    with fsdp_pass.no_sync(model):
        with fsdp_pass.no_sync(compiled):
            pass
        assert not any(b.gradient_sync for b in buffers)  # the inner block restores the outer state
    assert all(b.gradient_sync for b in buffers)
    fsdp_pass.set_requires_gradient_sync(compiled, False)
    assert not any(b.gradient_sync for b in buffers)
    fsdp_pass.set_requires_gradient_sync(compiled, True)
    assert all(b.gradient_sync for b in buffers)
