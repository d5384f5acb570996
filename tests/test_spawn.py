"""The multi-process harness: results come back by rank, and one failing rank ends the run within seconds."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fsdp_pass.testing.spawn import RankFailed, run_distributed


def _sum_of_ranks(rank: int, world: int) -> tuple[int, int]:
    total = torch.tensor(rank)
    dist.all_reduce(total)
    return rank, int(total)


def test_each_rank_result_comes_back_in_rank_order():
    assert run_distributed(_sum_of_ranks, 2) == [(0, 1), (1, 1)]


def _raise_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 1 never arrives


def test_a_failing_rank_ends_the_run_within_seconds():
    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_distributed(_raise_on_rank_1, 2, timeout=300, pg_timeout=300)
    elapsed = time.monotonic() - started
    assert info.value.rank == 1
    assert "ValueError: rank 1 gives up" in str(info.value)
    # Spawning two ranks takes a few seconds on a loaded machine; the timeouts are 300 s.
    assert elapsed < 60, f"the run took {elapsed:.0f} s to end after rank 1 failed"
