"""Parity: sharded training through the vescale backend equals single-process training of the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.testing.models import MLP, Llama, LlamaConfig, init_std, lm_loss
from parity import Case, run_case

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release

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


def llama_case(compiler: str, experts: int = 0, steps: int = 10, layers: int = 2, global_batch: int = 8,
               **options) -> Case:
    cfg = LlamaConfig(experts=experts, layers=layers)
    return Case(f"llama(experts={experts})/{compiler}/{options}", lambda: init_std(Llama(cfg)), _token_batch, _lm,
                global_batch=global_batch, steps=steps, options={"compiler": compiler, **options}, tolerance=TOLERANCE)


def _hf_llama(layers: int = 2):
    """An unmodified third-party model: transformers' Llama from a tiny config (no download)."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    cfg = HFLlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                        tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def hf_case(compiler: str, steps: int = 10, layers: int = 2) -> Case:
    # transformers initialises weights with std 0.02: with lr 1e-2 AdamW's normalised updates would
    # be half a weight's size per step and amplify rounding noise of near-zero gradients.
    return Case(f"hf-llama/{compiler}", lambda: _hf_llama(layers), _token_batch, lambda out, t: lm_loss(out.logits, t),
                steps=steps, options={"compiler": compiler}, tolerance=TOLERANCE,
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1))


def _compile_with_mode(mode: str):
    """torch.compile(model, backend="vescale", mode=mode), as users write it: torch.compile takes no options with a mode."""
    def prepare(model, options):
        assert not options, f"torch.compile refuses mode= with options= ({options})"
        return torch.compile(model, backend="vescale", mode=mode)
    return prepare


def _run_cases(rank: int, world: int, names: list[str], mesh_shape=None, hsdp_names: tuple[str, ...] = ()) -> None:
    """``names`` on ``mesh_shape`` (None: all ranks flat), then ``hsdp_names`` on a 2x2 mesh in the same processes."""
    from torch.distributed.device_mesh import init_device_mesh

    cases = {c.name: c for c in _all_cases()}
    for shape, chosen in ((mesh_shape, names), ((2, 2), hsdp_names)):
        if not chosen:
            continue
        mesh = init_device_mesh("cpu", shape) if shape else None
        for name in chosen:
            result = run_case(cases[name], rank, world, mesh=mesh)
            if rank == 0:
                print(f"[{world} ranks, mesh {shape}] {name}: loss {result['loss_rel']:.2g}, "
                      f"parameters {result['param_rel']:.2g}")


def _all_cases() -> list[Case]:
    return [
        mlp_case("aot_eager", True),
        mlp_case("aot_eager", False),
        llama_case("aot_eager"),
        llama_case("aot_eager", reshard_after_forward=False),  # under Inductor: test_backend's structure check
        # Inductor: one layer, 2 sequences a rank: test_schedule.py's graphs, compiled once between the two tests.
        llama_case("inductor", layers=1, global_batch=4),
        llama_case("aot_eager", experts=4),
        hf_case("aot_eager"),
        hf_case("inductor", steps=5, layers=1),
        # torch.compile's conventions: a mode with Inductor's meaning, and an Inductor key next to fsdp_pass's.
        Case("mlp/inductor/mode=max-autotune-no-cudagraphs", lambda: MLP(), _mlp_batch, _mse, steps=5,
             prepare=_compile_with_mode("max-autotune-no-cudagraphs"), tolerance=TOLERANCE),
        Case("mlp/inductor/epilogue_fusion=False", lambda: MLP(), _mlp_batch, _mse, steps=5,
             options={"compiler": "inductor", "prefetch": 1, "epilogue_fusion": False}, tolerance=TOLERANCE),
    ]


def test_single_process_without_process_group():
    for case in (mlp_case("aot_eager", steps=5), llama_case("aot_eager", steps=5)):
        run_case(case, 0, 1)


def _llama(compiler: str) -> list[str]:
    return [c.name for c in _all_cases() if c.name.startswith("llama(experts=0)/" + compiler + "/{}")]


@pytest.mark.parametrize("world", [2, 4])
def test_parity_aot_eager(world):
    """4 ranks also run the llama on a 2x2 HSDP mesh; reshard_after_forward=False and the HF llama run on 2
    ranks only (tests/test_hf_checkpoint.py fine-tunes HF models on 4)."""
    names = [c.name for c in _all_cases() if "aot_eager" in c.name]
    if world == 4:
        names = [n for n in names if "False" not in n and not n.startswith("hf-")]
    run_distributed(_run_cases, world, names, None, tuple(_llama("aot_eager")) if world == 4 else ())


def test_parity_inductor_2_ranks():
    """4 ranks (flat and 2x2 HSDP) run under aot_eager: test_parity_aot_eager[4]."""
    run_distributed(_run_cases, 2, [c.name for c in _all_cases() if "inductor" in c.name])
