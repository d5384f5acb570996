"""Train a model sharded by the vescale backend and single-process side by side; compare losses and parameters."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_pass
from fsdp_pass import RaggedShardTensor


@dataclass
class Case:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, int], tuple]  # (step, global_batch) -> (inputs, targets); inputs: a tensor or a tuple
    loss_fn: Callable
    global_batch: int = 8
    steps: int = 20
    options: dict = field(default_factory=dict)
    optimizer: Callable = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    tolerance: float = 1e-5
    # how the model is sharded and compiled: (model, backend options) → what to call; None: torch.compile
    # of the whole, unsharded model with backend="vescale"
    prepare: Callable[[nn.Module, dict], Callable] | None = None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of two tensors: ||a - b|| / ||b|| (Frobenius)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def run_case(case: Case, rank: int, world: int, mesh=None) -> dict:
    """Train ``case`` sharded on this rank and single-process; assert parity; return measurements."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = case.make_model()
    reference = copy.deepcopy(model)
    opt = case.optimizer(model.parameters())  # built before sharding: must keep working
    ref_opt = case.optimizer(reference.parameters())
    options = dict(case.options)
    if mesh is not None:
        options["mesh"] = mesh
    if case.prepare is None:
        compiled = torch.compile(model, backend="vescale", options=options)
    else:
        compiled = case.prepare(model, options)
    per_rank = case.global_batch // world
    worst_loss = 0.0
    for step in range(case.steps):
        inputs, targets = case.make_batch(step, case.global_batch)
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        args = inputs if isinstance(inputs, tuple) else (inputs,)  # every input's dim 0 is the batch
        loss = case.loss_fn(compiled(*(a[lo:hi] for a in args)), targets[lo:hi])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = case.loss_fn(reference(*args), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss)
            global_loss /= world
        worst_loss = max(worst_loss, abs(global_loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12))
    worst_param = 0.0
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, RaggedShardTensor), f"{case.name}: {name} was not sharded"
        diff = _rel(p.full_tensor().detach(), ref_params[name].detach())
        if diff > case.tolerance / 10 and rank == 0:
            print(f"{case.name}: {name} rel diff {diff:.3g}")
        worst_param = max(worst_param, diff)
    assert worst_loss <= case.tolerance, f"{case.name}: loss rel diff {worst_loss:.3g} > {case.tolerance}"
    assert worst_param <= case.tolerance, f"{case.name}: param rel diff {worst_param:.3g} > {case.tolerance}"
    return {"loss_rel": worst_loss, "param_rel": worst_param, "model": model, "reference": reference}


def counters() -> dict:
    return dict(torch._dynamo.utils.counters["stats"])


__all__ = ["Case", "counters", "fsdp_pass", "run_case"]
