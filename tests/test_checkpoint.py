"""Distributed checkpoints: save local pieces, load at another world size, continue training."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import fsdp_pass
from dist_harness import run_distributed
from models import Llama, LlamaConfig, init_std, lm_loss

GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER = 4, 3, 3


def _batch(step: int):
    tokens = torch.randint(0, 61, (GLOBAL_BATCH, 8), generator=torch.Generator().manual_seed(step))
    return tokens


def _train(model, opt, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    per_rank = GLOBAL_BATCH // world
    for step in steps:
        tokens = _batch(step)[rank * per_rank:(rank + 1) * per_rank]
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _new(seed: int, mesh_shape=None):
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = init_std(Llama(LlamaConfig()), seed)
    fsdp_pass.fully_shard(model, init_device_mesh("cpu", mesh_shape) if mesh_shape else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    return model, opt, compiled


def _save_worker(rank: int, world: int, path: str) -> None:
    model, opt, compiled = _new(0)
    _train(compiled, opt, rank, world, range(STEPS_BEFORE))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    continued = _train(compiled, opt, rank, world, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    if rank == 0:
        torch.save({"params": full, "losses": continued}, os.path.join(path, "reference.pt"))


def _load_worker(rank: int, world: int, path: str, saved_world: int, mesh_shape=None) -> None:
    model, opt, compiled = _new(1, mesh_shape)  # other initial values: everything must come from the checkpoint
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    reference = torch.load(os.path.join(path, "reference.pt"))
    for name, p in model.named_parameters():
        assert isinstance(p, fsdp_pass.RaggedShardTensor)
        assert torch.equal(p.full_tensor(), reference["params"][name]), name
    losses = _train(compiled, opt, rank, world, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    if world == saved_world:
        assert losses == reference["losses"], (losses, reference["losses"])  # bitwise
    else:  # another world size sums gradients in another order
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def checkpoint_at_two_ranks(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt"))
    run_distributed(_save_worker, 2, path)
    return path


@pytest.mark.parametrize("load_world, mesh_shape", [(2, None), (4, None), (1, None), (4, (2, 2))],
                         ids=["2 ranks", "4 ranks", "1 rank", "2x2 HSDP"])
def test_save_at_two_ranks_load_elsewhere_and_continue(checkpoint_at_two_ranks, load_world, mesh_shape):
    run_distributed(_load_worker, load_world, checkpoint_at_two_ranks, 2, mesh_shape)
