"""Training loops as users write them train as one process does: generated loop programs and named regressions.

[Note: the loop-program tester] in fsdp_pass/testing/loop_programs.py; [Note: the gradient state of a
parameter] in fsdp_pass/buckets/dbuffer.py. One spawned 2-rank group runs the named cases and a fixed sample
of generated programs under every way of sharding; ``python -m fsdp_pass.testing.loop_programs`` soaks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_pass
from fsdp_pass.buckets.dbuffer import buffers_of
from fsdp_pass.compile.backend import records
from fsdp_pass.sharding.fsdp_module import FSDPPassModule
from fsdp_pass.tensor.swap import in_live_graph
from fsdp_pass.testing import loop_programs as lp
from fsdp_pass.testing.loop_programs import Event
from fsdp_pass.testing.models import MLP
from fsdp_pass.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


def _steps(*forwards: Event, zero_first: bool = False) -> list[Event]:
    """One optimizer step per forward, ``zero_grad()`` between forward and backward (or before the forward)."""
    program = []
    for forward in forwards:
        zero = [Event("zero_grad")]
        program += (zero + [forward] if zero_first else [forward] + zero) + [Event("backward"), Event("step")]
    return program


# Each found a way to train differently from one process in the code before [Note: the gradient state of a
# parameter]; all run under every sharding.
REGRESSIONS: dict[str, list[Event]] = {
    # the loop: AdamW decayed the skipped branch's weight through a zero gradient
    "zero_grad between forward and backward, a branch skipped":
        _steps(*(Event("forward", branch=s % 2 == 0) for s in range(4))),
    "zero_grad between forward and backward, an expert skipped":
        _steps(*(Event("forward", experts=(True, s % 2 == 0)) for s in range(4))),
    # a forward whose loss is dropped read the branch; the backward of the next never reached it
    "a forward whose loss is dropped": [Event("forward", branch=True), Event("forward", branch=False),
                                        Event("backward"), Event("step")],
    # the micro-batch that syncs does not reach the expert the first one used: its sum was never reduced
    "no_sync: the syncing micro-batch skips an expert":
        [Event("sync", on=False), Event("forward", experts=(True, True)), Event("backward"), Event("sync", on=True),
         Event("forward", experts=(True, False)), Event("backward"), Event("step"), Event("zero_grad"),
         *_steps(Event("forward", experts=(True, False)))],
    # zero_grad(set_to_none=True) between micro-batches drops what the earlier ones accumulated
    "zero_grad between no_sync micro-batches":
        [Event("sync", on=False), Event("forward"), Event("backward"), Event("zero_grad"), Event("sync", on=True),
         Event("forward", branch=False), Event("backward"), Event("step")],
    # the same, the eager part's sum cleared and not reached again: its .grad must stay None (the end-of-backward
    # agreement once sent what the sum held before the clear as reached)
    "zero_grad between no_sync micro-batches, the syncing one skips the eager part":
        [Event("sync", on=False), Event("forward", branch=False), Event("backward"), Event("zero_grad"),
         Event("sync", on=True), Event("forward", eager=False), Event("backward"), Event("step")],
    # a rank whose micro-batch skipped an expert another rank used: its .grad must not stay None (the first
    # forward puts both experts in one bucket; each graph is compiled on every rank first: a compile over
    # different parameters is refused)
    "an expert one rank skips": _steps(Event("forward"), Event("forward", experts=(True, False)),
                                       Event("forward", experts=(False, True)),
                                       Event("forward", experts=(True, False), skew=True),
                                       Event("forward", experts=(False, True), skew=True)),
    # a rank whose tokens reach no expert holds no gradient for the experts' bucket that another rank reduces: it
    # must still join that reduce-scatter (eager units: agreed at the backward's end). Not for fully_shard +
    # compile: a graph gathers no bucket it does not read, so ranks running different graphs gather differently
    "every expert one rank skips": _steps(Event("forward"), Event("forward", experts=(False, False)),
                                          Event("forward", experts=(False, False), skew=True),
                                          Event("forward", experts=(True, True), skew=True)),
    "frozen then unfrozen": [*_steps(Event("forward")), Event("freeze", on=True, target="branch"),
                             *_steps(Event("forward")), Event("freeze", on=False, target="branch"),
                             *_steps(Event("forward"))],
    # requires_grad read at the flush instead of at each backward: a parameter frozen between no_sync
    # micro-batches lost what it gathered before (one process keeps its .grad and steps it); one frozen for a
    # micro-batch (or from its forward to its backward) and unfrozen before the flush got that one's gradient
    "freeze and unfreeze around no_sync micro-batches":
        [Event("sync", on=False), Event("forward"), Event("backward"), Event("freeze", on=True, target="branch"),
         Event("sync", on=True), Event("forward", branch=False), Event("backward"), Event("step"),
         Event("zero_grad"), Event("freeze", on=True, target="head"), Event("sync", on=False), Event("forward"),
         Event("backward"), Event("forward"), Event("freeze", on=False, target="head"),
         Event("freeze", on=True, target="moe.experts.1"), Event("backward"),
         Event("freeze", on=False, target="moe.experts.1"), Event("sync", on=True), Event("forward"),
         Event("backward"), Event("step")],
}


# the regressions some shardings cannot run, and the shardings that run them
ONLY: dict[str, list[str]] = {"every expert one rank skips": ["eager fully_shard", "whole-model compile"]}


def _named_and_sampled(rank: int, world: int, seeds: list[int]) -> list[str]:
    found = []
    for name, program in REGRESSIONS.items():
        shardings = ONLY.get(name, list(lp.SHARDINGS))
        found += [f"{name}: {line}" for line in lp.run_programs([program], shardings, rank, world)]
    found += lp.run_programs([lp.draw_program(seed) for seed in seeds], list(lp.SHARDINGS), rank, world)
    return found


def test_training_loops_match_one_process():
    """The named regressions and a fixed sample of generated loop programs, every sharding, 2 ranks."""
    found = run_distributed(_named_and_sampled, 2, list(range(3)), timeout=240)[0]
    assert not found, "\n".join(found)


def _refusals(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = lp.BranchyModel()
    fsdp_pass.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(2, lp.DIM), torch.randn(2, 2)
    fsdp_pass.set_requires_gradient_sync(model, False)
    F.mse_loss(model(x), y).backward()
    opt.zero_grad(set_to_none=False)  # a write into the views the unreduced sum cannot follow
    fsdp_pass.set_requires_gradient_sync(model, True)
    with pytest.raises(RuntimeError, match=r"the \.grad of parameter '[\w.]+' \(shape .*\) was written in place .*"
                                           r"set_to_none=True"):
        F.mse_loss(model(x), y).backward()


def test_zero_grad_without_set_to_none_while_accumulating_is_refused():
    run_distributed(_refusals, 2)


def _frozen_when_sharded(rank: int, world: int) -> None:
    torch._dynamo.reset()
    model = lp.BranchyModel()
    model.branch.requires_grad_(False)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    compiled(torch.randn(2, lp.DIM), eager=False).sum().backward()  # shards the branch into a frozen bucket
    model.branch.requires_grad_(True)  # one process would train it from here on: refused, not left at None
    with pytest.raises(RuntimeError, match=r"parameter 'branch\.weight' \(shape \(8, 8\)\) was frozen"):
        compiled(torch.randn(2, lp.DIM), eager=False)


def test_unfreezing_a_parameter_frozen_when_sharded_is_refused():
    run_distributed(_frozen_when_sharded, 2)


def _divide_factor_of_eager_only_buckets(rank: int, world: int) -> None:
    torch._dynamo.reset()
    model = lp.BranchyModel()
    lp._eager(model, {})  # fully_shard per unit and root: the eager part's bucket is made before the compile
    torch.compile(model, backend="vescale", options={"compiler": "aot_eager", "gradient_divide_factor": 1.0})(
        torch.randn(2, lp.DIM))
    divisors = {b.names[0]: b.grad_divisor for b in buffers_of(model)}
    assert divisors == dict.fromkeys(divisors, 1.0), divisors  # eager.proj's bucket too (no graph reads it)


def test_compile_gradient_divide_factor_reaches_buckets_no_graph_reads():
    run_distributed(_divide_factor_of_eager_only_buckets, 2)


def _ignored_then_stepped(rank: int, world: int) -> None:
    model = MLP()
    ignored = model.layers[0].weight
    fsdp_pass.fully_shard(model, ignored_params={ignored})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 19, generator=torch.Generator().manual_seed(rank))).sum().backward()
    opt.step()  # the ignored weight's gradient differs across ranks: the user's, as in FSDP2


def test_ignored_params_are_left_to_the_user_at_the_optimizer_step():
    run_distributed(_ignored_then_stepped, 2)


def test_fsdp2_methods_on_a_module_without_parameters_of_its_own_are_no_ops():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    for layer in model:
        fsdp_pass.fully_shard(layer)
    fsdp_pass.fully_shard(model)
    assert isinstance(model, FSDPPassModule) and not model._own_parameters()
    model.set_requires_gradient_sync(False, recurse=False)  # Lightning's _FSDPNoSync, on every FSDPModule
    model.set_gradient_divide_factor(1.0)  # torchtitan, on every FSDPModule
    model.set_reshard_after_forward(False, recurse=False)
    model.unshard()
    model.reshard()
    assert all(b.gradient_sync and b.gradient_divide_factor is None and b.reshard_after_forward is True
               for b in buffers_of(model))
    model.set_requires_gradient_sync(False)  # recurse=True reaches the children's buckets
    assert not any(b.gradient_sync for b in buffers_of(model))


def _reshard_none_then_compiled(rank: int, world: int) -> dict:
    """FSDP2's reshard_after_forward=None (inner modules reshard, the root keeps) under one whole-model graph."""
    case = lp.BranchyModel
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = case()
    reference = case()
    reference.load_state_dict(model.state_dict())
    fsdp_pass.fully_shard(model.moe, reshard_after_forward=None)
    fsdp_pass.fully_shard(model, reshard_after_forward=None)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, lp.DIM, generator=g), torch.randn(2 * world, 2, generator=g)
        F.mse_loss(compiled(x[2 * rank:2 * rank + 2], eager=False), y[2 * rank:2 * rank + 2]).backward()
        F.mse_loss(reference(x, eager=False), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    worst = max(((p.full_tensor() - q).norm() / q.norm()).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    assert worst < lp.TOLERANCE, worst
    backward = [r.modules["backward"] for r in records() if "backward" in r.modules][-1]
    regathered = len(backward.graph.find_nodes(op="call_function", target=_ALL_GATHER))
    return {"kept": [b.reshard_after_forward for b in buffers_of(model)], "regathered": regathered}


def test_reshard_after_forward_none_then_a_whole_model_compile_trains_like_one_process():
    result = run_distributed(_reshard_none_then_compiled, 2)[0]
    assert sorted(result["kept"]) == [False, True], result["kept"]  # the root keeps, the inner unit reshards
    # the root bucket is gathered first and kept; the inner one is the graph's last, kept by the default
    # reshard_last_bucket=False: backward gathers nothing again (True for both would gather the root again)
    assert result["regathered"] == 0, result


def test_a_kept_no_grad_view_is_not_a_live_graph():
    p = nn.Parameter(torch.randn(4))
    with torch.no_grad():
        view = p[:2]  # holds its base: the second owner a live graph's accumulator would be
    assert not in_live_graph(p)
    q = nn.Parameter(torch.randn(4))
    loss = (q * 2).sum()  # a forward not yet run backward
    assert in_live_graph(q)
    del view, loss
