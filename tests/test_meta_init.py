"""A model built on the meta device: only local shards are allocated, initialized module by module."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import fsdp_pass
from fsdp_pass.runtime.dbuffer import bucket_of
from fsdp_pass.testing.spawn import run_distributed


class Stack(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 12):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: keeps the embedding's initialization


def _peak_bytes(prof) -> int:
    """Largest sum of live CPU allocations seen by the profiler, in time order.

    Allocations are counted in the allocating op's *self* memory, frees not tied to an op in
    ``[memory]`` events; children are not double counted.
    """
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    reference = Stack()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Stack()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fsdp_pass.fully_shard(model)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p, fsdp_pass.RaggedShardTensor) and not p.to_local().is_meta
        assert torch.equal(p.full_tensor(), ref), name  # same values as a model built on the CPU
    assert model.head.weight is model.embed.weight
    buffers = {id(b): b for b in (bucket_of(p)[0] for p in model.parameters())}.values()
    local_share = sum(b.layout.shard_size * 4 for b in buffers)
    largest_module = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    total = sum(p.numel() * 4 for p in model.parameters())
    peak = _peak_bytes(prof)
    assert local_share + largest_module < total  # the bound below is tighter than the full model
    scalars = 1024  # 0-dim temporaries inside init functions
    rng_states = 2 * torch.get_rng_state().numel()  # before/after copies telling whether an init drew random numbers
    assert peak <= local_share + largest_module + scalars + rng_states, (peak, local_share, largest_module, total)


def test_meta_init_matches_cpu_init_and_allocates_local_share_plus_one_module():
    run_distributed(_worker, 2)


def test_module_without_reset_parameters_is_refused_untouched():
    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), NoReset())
    with pytest.raises(TypeError, match=r"\['NoReset'\].*reset_parameters"):
        fsdp_pass.fully_shard(model)
    assert not any(isinstance(p, fsdp_pass.RaggedShardTensor) for p in model.parameters())
