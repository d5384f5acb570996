"""Models whose modules define ``__getattr__`` (diffusers, peft) train and checkpoint like one process on
2 gloo ranks, with ``named_parameters()`` names in the plan and in ``block_sizes``
([Note: parameters known by identity] in compile/passes/detect.py); and on 4 ranks as 2 nodes of 2, whose
buckets gather and reduce in two levels."""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_pass
from fsdp_pass.testing.spawn import run_distributed
from parity import Case, run_case

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fsdp_pass.testing.third_party import LORA_QUERY_WEIGHTS, tiny_lora_llama, tiny_unet, tiny_unet_conditional  # noqa: E402

WORLD = 2
TOLERANCE = 1e-5  # fp32, relative (Frobenius); reached values are printed
LORA_ROWS = 16  # block rows asked for the frozen query projections by their peft names


def _unet_batch(step: int, batch: int):
    g = torch.Generator().manual_seed(700 + step)
    return (torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 1000, (batch,), generator=g)), \
        torch.randn(batch, 3, 8, 8, generator=g)


def _conditional_batch(step: int, batch: int):
    g = torch.Generator().manual_seed(800 + step)
    inputs = (torch.randn(batch, 4, 8, 8, generator=g), torch.randint(0, 1000, (batch,), generator=g),
              torch.randn(batch, 3, 8, generator=g))
    return inputs, torch.randn(batch, 4, 8, 8, generator=g)


def _tokens(step: int, batch: int):
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, 61, (batch, 8), generator=g)
    return tokens, tokens


def _lm(out, tokens):
    return F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _sample_mse(out, target):
    return F.mse_loss(out.sample, target)


def _sgd(params):
    # Attention key biases get an exactly-zero gradient in exact math (softmax ignores a shift shared by all
    # keys), so theirs is rounding noise, which AdamW would normalise into full-size, run-dependent updates.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


CASES = [
    # aot_eager for the UNets: naming and sharding happen before the compiler, and Inductor's code generation for
    # them costs minutes of CPU; `python tests/test_third_party_models.py` runs UNet2DModel under Inductor too
    Case("diffusers UNet2DModel/aot_eager", tiny_unet, _unet_batch, _sample_mse, steps=3, optimizer=_sgd,
         options={"compiler": "aot_eager"}),
    Case("diffusers UNet2DConditionModel/aot_eager", tiny_unet_conditional, _conditional_batch, _sample_mse, steps=3,
         optimizer=_sgd, options={"compiler": "aot_eager"}),
    Case("peft LoRA llama/inductor", tiny_lora_llama, _tokens, _lm, steps=3,
         options={"block_sizes": {LORA_QUERY_WEIGHTS: LORA_ROWS}}),
]


# run by hand (see the end of this file), not by the suite
UNET_INDUCTOR = Case("diffusers UNet2DModel/inductor", tiny_unet, _unet_batch, _sample_mse, steps=3, optimizer=_sgd,
                     options={})


def _check_checkpoint(case: Case, model, reference) -> float:
    """The full state dict, loaded into a plain model built afresh, equals the reference in every element."""
    full = fsdp_pass.get_full_state_dict(model)  # collective
    if dist.get_rank() != 0:
        return 0.0
    plain = case.make_model()
    plain.load_state_dict(full, strict=True)
    worst = 0.0
    for name, expected in reference.state_dict().items():
        got = plain.state_dict()[name]
        assert got.shape == expected.shape, name
        worst = max(worst, float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)))
    assert worst <= TOLERANCE, worst
    return worst


def _check_dcp(case: Case, model, reference, path: str) -> float:
    """A DCP checkpoint of the sharded model, loaded by every rank into a plain model built afresh, equals the
    reference in every element (the keys are the plain model's own: modules with ``__getattr__`` included)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    plain = case.make_model()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path)
    plain.load_state_dict(state["model"], strict=True)
    worst = 0.0
    for name, expected in reference.state_dict().items():
        got = plain.state_dict()[name]
        worst = max(worst, float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)))
    assert worst <= TOLERANCE, worst
    return worst


def _check_lora_names_and_blocks(model) -> None:
    """explain() names the parameters as named_parameters() does, and the block asked by that name took effect."""
    names = {n for b in fsdp_pass.explain(model, print_output=False).buffers for n in b.names}
    assert names == {n for n, _ in model.named_parameters()}, sorted(names ^ {n for n, _ in model.named_parameters()})
    matched = [(n, p) for n, p in model.named_parameters() if fnmatch.fnmatch(n, LORA_QUERY_WEIGHTS)]
    assert len(matched) == 2, [n for n, _ in matched]
    for name, p in matched:
        assert p.placement.block == LORA_ROWS * p.shape[1], (name, p.placement)


def _train_all(rank: int, world: int, directory: str, names: list[str]) -> None:
    for i, case in enumerate(c for c in [*CASES, UNET_INDUCTOR] if c.name in names):
        result = run_case(case, rank, world)
        worst_checkpoint = _check_checkpoint(case, result["model"], result["reference"])
        worst_dcp = _check_dcp(case, result["model"], result["reference"], f"{directory}/case{i}")
        if case.name.startswith("peft"):
            _check_lora_names_and_blocks(result["model"])
        if rank == 0:
            print(f"{case.name}: loss {result['loss_rel']:.1e}, parameters {result['param_rel']:.1e}, "
                  f"full state dict {worst_checkpoint:.1e}, DCP {worst_dcp:.1e}")


@pytest.mark.slow
def test_diffusers_and_peft_models_train_and_checkpoint_like_one_process(tmp_path):
    run_distributed(_train_all, WORLD, str(tmp_path), [c.name for c in CASES])


def _train_on_two_nodes(rank: int, world: int) -> None:
    """The cases, told by the launcher's variables that they run on 2 nodes of 2 ranks: every bucket gathers and
    reduces in two levels ([Note: collectives in two levels across nodes] in buckets/node_collectives.py)."""
    import dataclasses
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_pass.buckets.dbuffer import buffers_of

    os.environ["GROUP_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank // 2), "2"
    mesh = init_device_mesh("cpu", (world,))
    for case in CASES:  # aot_eager: the collectives are the same under Inductor, and cost no code generation here
        case = dataclasses.replace(case, name=case.name.split("/")[0] + "/aot_eager",
                                   options={**case.options, "compiler": "aot_eager"})
        result = run_case(case, rank, world, mesh)
        assert all(b.mesh.node_levels() for b in buffers_of(result["model"])), case.name
        worst_checkpoint = _check_checkpoint(case, result["model"], result["reference"])
        if rank == 0:
            print(f"{case.name} on 2 nodes of 2: loss {result['loss_rel']:.1e}, parameters {result['param_rel']:.1e}, "
                  f"full state dict {worst_checkpoint:.1e}")


@pytest.mark.slow
def test_diffusers_and_peft_models_train_like_one_process_on_two_nodes_of_two():
    run_distributed(_train_on_two_nodes, 4)


if __name__ == "__main__":  # every case one by one, with its time: python tests/test_third_party_models.py [word ...]
    import sys
    import tempfile
    import time

    for case in [*CASES, UNET_INDUCTOR]:
        if len(sys.argv) > 1 and not any(word in case.name for word in sys.argv[1:]):
            continue
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as directory:
            run_distributed(_train_all, WORLD, directory, [case.name], timeout=3000)
        print(f"{case.name}: {time.perf_counter() - started:.0f} s", flush=True)
