"""Parity: sharded training through the vescale backend equals single-process training of the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_distributed
from models import MLP, Llama, LlamaConfig, init_std, lm_loss
from parity import Case, run_case

TOLERANCE = 1e-5  # fp32, relative to the largest value; reached values are printed by each case


def _mlp_batch(step: int, batch: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 19, generator=g), torch.randn(batch, 5, generator=g)


def _token_batch(step: int, batch: int, vocab: int = 61, seq: int = 8):
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    return tokens, tokens


def _mse(out, target):
    return F.mse_loss(out, target)


def _lm(out, tokens):
    return lm_loss(out, tokens)


def mlp_case(compiler: str, reshard: bool = True, steps: int = 20) -> Case:
    return Case(f"mlp/{compiler}/reshard={reshard}", lambda: MLP(), _mlp_batch, _mse, steps=steps,
                options={"compiler": compiler, "reshard_after_forward": reshard}, tolerance=TOLERANCE)


def llama_case(compiler: str, experts: int = 0, steps: int = 20, **options) -> Case:
    cfg = LlamaConfig(experts=experts)
    return Case(f"llama(experts={experts})/{compiler}/{options}", lambda: init_std(Llama(cfg)), _token_batch, _lm,
                steps=steps, options={"compiler": compiler, **options}, tolerance=TOLERANCE)


def _run_cases(rank: int, world: int, names: list[str]) -> None:
    cases = {c.name: c for c in _all_cases()}
    for name in names:
        result = run_case(cases[name], rank, world)
        if rank == 0:
            print(f"[{world} ranks] {name}: {result}")


def _all_cases() -> list[Case]:
    return [
        mlp_case("aot_eager", True),
        mlp_case("aot_eager", False),
        mlp_case("inductor", True),
        mlp_case("inductor", False),
        llama_case("aot_eager"),
        llama_case("inductor"),
        llama_case("aot_eager", experts=4),
    ]


def test_single_process_without_process_group():
    for case in (mlp_case("aot_eager", steps=5), llama_case("aot_eager", steps=5)):
        run_case(case, 0, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_aot_eager(world):
    names = [c.name for c in _all_cases() if "aot_eager" in c.name]
    run_distributed(_run_cases, world, names)


@pytest.mark.parametrize("world", [2])
def test_parity_inductor(world):
    names = [c.name for c in _all_cases() if "inductor" in c.name]
    run_distributed(_run_cases, world, names)
