"""Parity: sharded training through the vescale backend equals single-process training of the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.testing.models import MLP, Llama, LlamaConfig, init_std, lm_loss
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


def mlp_case(compiler: str, reshard: bool = True, steps: int = 10) -> Case:
    return Case(f"mlp/{compiler}/reshard={reshard}", lambda: MLP(), _mlp_batch, _mse, steps=steps,
                options={"compiler": compiler, "reshard_after_forward": reshard}, tolerance=TOLERANCE)


def llama_case(compiler: str, experts: int = 0, steps: int = 10, **options) -> Case:
    cfg = LlamaConfig(experts=experts)
    return Case(f"llama(experts={experts})/{compiler}/{options}", lambda: init_std(Llama(cfg)), _token_batch, _lm,
                steps=steps, options={"compiler": compiler, **options}, tolerance=TOLERANCE)


def _hf_llama():
    """An unmodified third-party model: transformers' Llama from a tiny config (no download)."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    cfg = HFLlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                        tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def hf_case(compiler: str, steps: int = 10) -> Case:
    # transformers initialises weights with std 0.02: with lr 1e-2 AdamW's normalised updates would
    # be half a weight's size per step and amplify rounding noise of near-zero gradients.
    return Case(f"hf-llama/{compiler}", _hf_llama, _token_batch, lambda out, t: lm_loss(out.logits, t),
                steps=steps, options={"compiler": compiler}, tolerance=TOLERANCE,
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1))


def _run_cases(rank: int, world: int, names: list[str], mesh_shape=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
    cases = {c.name: c for c in _all_cases()}
    for name in names:
        result = run_case(cases[name], rank, world, mesh=mesh)
        if rank == 0:
            print(f"[{world} ranks, mesh {mesh_shape}] {name}: {result}")


def _all_cases() -> list[Case]:
    return [
        mlp_case("aot_eager", True),
        mlp_case("aot_eager", False),
        mlp_case("inductor", False),  # reshard after forward under Inductor: the llama case
        llama_case("aot_eager"),
        llama_case("aot_eager", reshard_after_forward=False),
        llama_case("inductor"),
        llama_case("aot_eager", experts=4),
        hf_case("aot_eager"),
        hf_case("inductor", steps=5),
    ]


def test_single_process_without_process_group():
    for case in (mlp_case("aot_eager", steps=5), llama_case("aot_eager", steps=5)):
        run_case(case, 0, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_aot_eager(world):
    names = [c.name for c in _all_cases() if "aot_eager" in c.name]
    run_distributed(_run_cases, world, names)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_inductor(world):
    names = [c.name for c in _all_cases() if "inductor" in c.name]
    if world == 4:  # four Inductor compiles per case on two cores: our llama only (transformers' Llama
        names = [n for n in names if n.startswith("llama")]  # runs under Inductor on 2 ranks, aot_eager on 4)
    run_distributed(_run_cases, world, names)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_parity_hsdp_2x2(compiler):
    names = [c.name for c in _all_cases() if c.name.startswith("llama(experts=0)/" + compiler + "/{}")]
    run_distributed(_run_cases, 4, names, (2, 2))
