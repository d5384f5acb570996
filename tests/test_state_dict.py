"""Whole state dicts of sharded models: ``get_full_state_dict`` on rank 0, ``set_full_state_dict`` on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_pass
from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release


def _worker(rank: int, world: int) -> None:
    original = init_std(Llama(LlamaConfig()), 0)
    expected = {n: t.clone() for n, t in original.state_dict().items()}
    fsdp_pass.fully_shard(original)
    exported = fsdp_pass.get_full_state_dict(original)  # rank 0 only, on the CPU
    if rank == 0:
        assert exported.keys() == expected.keys()
        assert all(torch.equal(exported[n], expected[n]) for n in expected)
        assert not any(isinstance(t, fsdp_pass.RaggedShardTensor) for t in exported.values())
    else:
        assert exported == {}

    other = fsdp_pass.fully_shard(init_std(Llama(LlamaConfig()), 1))  # other values, same shapes
    fsdp_pass.set_full_state_dict(other, expected)
    assert all(torch.equal(p.full_tensor(), expected[n]) for n, p in other.named_parameters())
    with pytest.raises(KeyError, match="missing keys"):
        fsdp_pass.set_full_state_dict(other, {})
    with pytest.raises(ValueError, match="has shape"):
        fsdp_pass.set_full_state_dict(other, {**expected, "norm.weight": torch.ones(3)})
    dist.barrier()


def test_full_state_dict_exports_on_rank_zero_and_loads_pieces():
    run_distributed(_worker, 2)
