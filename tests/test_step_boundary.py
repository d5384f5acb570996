"""Across the step boundary: the last reduce-scatter left in flight into the optimizer step
(``overlap_last_reduce``, [Note: the last reduce-scatter overlaps the optimizer step]) and the next
step's first all-gather issued when the step ends (``prefetch_next_step``, [Note: the next step's
first gather starts at the optimizer step]).

Bitwise against the same model compiled without the options, in the same processes, for the ways a
training loop reads the gradients: torch's AdamW (foreach and fused) and SGD, ``clip_grad_norm_``, a
``zero_grad(set_to_none=True)`` that leaves the gradient unread, two backwards into one gradient,
``no_sync`` accumulation; and for the ways a parameter changes between the step and the next forward
(then the prefetched gather must not be used): an in-place write on every rank, a write to one rank's
piece only, ``load_state_dict``, ``fsdp_pass.unshard(writeback=True)``.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist

import fsdp_pass
from fsdp_pass.compile.backend import records
from fsdp_pass.optim import AdamW8bit, Muon, Shampoo, muon_param_groups
from fsdp_pass.step import prefetch as step_prefetch
from fsdp_pass.tensor.in_flight import any_in_flight
from fsdp_pass.buckets.dbuffer import buffers_of
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss
from fsdp_pass.testing.spawn import run_distributed

STEPS = 2


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 61, (2, 8), generator=g)


def _pair():
    """The same model twice: compiled with and without ``overlap_last_reduce``, ``prefetch_next_step`` and
    ``step_reduced_first``."""
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig()))
    models = []
    for overlap in (True, False):
        m = copy.deepcopy(model)
        models.append(torch.compile(m, backend="vescale", options={
            "compiler": "aot_eager", "min_bucket_bytes": 0, "overlap_last_reduce": overlap,
            "prefetch_next_step": overlap, "step_reduced_first": overlap}))
    return models


def _assert_same(tag: str, a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.detach().full_tensor(), q.detach().full_tensor()), f"{tag}: parameter {name} differs"
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"{tag}: {name}.grad is None on one model only")
        if p.grad is not None:
            assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), f"{tag}: {name}.grad differs"


def _train(tag: str, rank: int, models, make_opt, read: dict, steps: int = STEPS, micro: int = 1,
           no_sync: bool = False) -> None:
    opts = [make_opt(m) for m in models]
    for step in range(steps):
        for model, opt in zip(models, opts):
            for k in range(micro):
                if no_sync and k < micro - 1:
                    with fsdp_pass.no_sync(model):
                        lm_loss(model(_batch(step * micro + k, rank)), _batch(step * micro + k, rank)).backward()
                else:
                    lm_loss(model(_batch(step * micro + k, rank)), _batch(step * micro + k, rank)).backward()
            # A backward into a gradient already held reduces at once (the later micro-batches; steps
            # after one that keeps its gradients).
            if model is models[0] and micro == 1 and (step == 0 or read.get("zeroes", True)):
                assert any_in_flight(), f"{tag}: nothing in flight after backward"
            read["step"](model, opt)
            if model is models[0]:
                assert step_prefetch.in_flight() == read.get("prefetches", True), f"{tag}: prefetch after the step"
            read.get("write", lambda m: None)(model)
        assert not any_in_flight(), f"{tag}: a gradient left in flight after the step"
        _assert_same(f"{tag} step {step}", *models)


def _step(model, opt) -> None:
    opt.step()
    opt.zero_grad()


def _clip_and_step(model, opt) -> None:
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    assert total.item() > 0.05  # the clip scales: the norm read every gradient, the deferred one included
    opt.step()


def _unread_then_cleared(model, opt) -> None:
    opt.zero_grad(set_to_none=True)  # nobody reads the gradient: the next forward finishes its reduce-scatter
    lm_loss(model(_batch(99, dist.get_rank())), _batch(99, dist.get_rank())).backward()  # settles it
    opt.step()
    opt.zero_grad()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _shampoo(model):
    return Shampoo(model.parameters(), lr=1e-2)


def _adamw8bit(model):
    return AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=256, block_size=64)  # 8-bit moments on this tiny model


class _MuonAndAdamW:
    """Muon for the layers' matrices, AdamW for the rest (``muon_param_groups``): two optimizers share
    each layer's bucket."""

    def __init__(self, model):
        matrices, rest = muon_param_groups(model)
        self.optimizers = [Muon(matrices, lr=0.02), torch.optim.AdamW([p for _, p in rest], lr=1e-2)]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()


def _reduced_first(first, passes: list) -> Callable:
    """A step, ``optimizer.step()``, recording on model ``first``'s optimizers, per pass, whether a
    reduce-scatter was still in flight when it ended (``step_reduced_first`` splits their steps)."""

    def record(optimizer, args, kwargs):
        passes.append(any_in_flight())

    def step(model, opt) -> None:
        for o in getattr(opt, "optimizers", [opt]):
            if model is first:
                groups = [[id(p) for p in g["params"]] for g in o.param_groups]
                handle = o.register_step_post_hook(record)
                o.step(None)  # as accelerate calls it: a closure of None is no closure
                handle.remove()
                assert [[id(p) for p in g["params"]] for g in o.param_groups] == groups, "a split step left its groups narrowed"
            else:
                o.step()
        opt.zero_grad()

    return step


def _write_everywhere(model) -> None:
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.5)


def _write_one_piece(model) -> None:
    """Rank 1 alone changes its own piece: every rank's prefetched copy of it is stale."""
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.tok_embeddings.weight.to_local().add_(1.0)


def _load_state_dict(model) -> None:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state[next(k for k in state if k.endswith("tok_embeddings.weight"))].mul_(-1.0)
    model.load_state_dict(state)


def _unshard_writeback(model) -> None:
    with fsdp_pass.unshard(model, writeback=True):
        with torch.no_grad():
            model.tok_embeddings.weight[0].fill_(0.25)


def _count_takes(taken: list[bool]) -> None:
    """Record, for every forward that found a gather in flight for its first bucket, whether it took it."""
    take = step_prefetch.take

    def counting(targets):
        in_flight = step_prefetch.in_flight()
        gathered = take(targets)
        if in_flight:
            taken.append(gathered is not None)
        return gathered

    step_prefetch.take = counting


def _cases(rank: int, world: int) -> None:
    """One pair of models through every way of reading the gradients, one after another (each with
    optimizers of its own): one compile per model."""
    models = _pair()
    taken: list[bool] = []
    _count_takes(taken)
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731
    _train("AdamW foreach", rank, models, adamw, {"step": _step})
    _train("AdamW fused", rank, models, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
           {"step": _step}, steps=1)
    _train("SGD + clip_grad_norm_, gradients kept", rank, models,
           _sgd, {"step": _clip_and_step, "zeroes": False}, steps=2)
    for model in models:
        model.zero_grad()
    _train("zero_grad(set_to_none) before any read", rank, models, adamw, {"step": _unread_then_cleared}, steps=1)
    _train("two backwards into one gradient", rank, models, adamw, {"step": _step}, steps=1, micro=2)
    _train("no_sync", rank, models, adamw, {"step": _step}, steps=2, micro=3, no_sync=True)
    # the first micro-batch after a step accumulates: it took the gathers that step issued
    assert any("forward (accumulate, prefetched)" in r.modules for r in records()), "no_sync took no prefetched gather"
    _train("Muon and AdamW", rank, models, _MuonAndAdamW, {"step": _step})
    assert taken and all(taken), f"forwards after a step without writes took the prefetched gather: {taken}"
    for name, make_opt in (("AdamW foreach", adamw),
                           ("AdamW fused", lambda m: torch.optim.AdamW(m.parameters(), fused=True)), ("SGD", _sgd),
                           ("Muon and AdamW", _MuonAndAdamW), ("Shampoo", _shampoo), ("AdamW8bit", _adamw8bit)):
        passes: list[bool] = []
        _train(f"{name}, split by step_reduced_first", rank, models, make_opt, {"step": _reduced_first(models[0], passes)},
               steps=1)
        if make_opt in (_MuonAndAdamW, _shampoo, _adamw8bit):
            # They redistribute the blocks a rank boundary cuts in this pair's layout. On CPU a collective
            # first finishes the reduce-scatter in flight ([Note: one collective in flight on gloo]).
            assert not any(passes), f"{name}: a reduce-scatter in flight beside another collective: {passes}"
        else:
            # One more pass than optimizers: every pass but the embedding's, the last, ran with its gradient in flight.
            assert passes == [True, False], f"{name}: passes (in flight at their end) {passes}"
    for write in (_write_everywhere, _write_one_piece, _load_state_dict, _unshard_writeback):
        taken.clear()
        _train(write.__name__, rank, models, adamw, {"step": _step, "write": write})
        assert taken[-1] is False, f"{write.__name__}: the forward after the write took the stale gather"
    forward = next(r.modules for r in records() if "forward (prefetched)" in r.modules)
    gathers = [len(forward[k].graph.find_nodes(op="call_function", target=torch.ops._c10d_functional
                                               .all_gather_into_tensor.default))
               for k in ("forward", "forward (prefetched)")]
    # The embedding's and the first layer's (prefetch=1: two gathers are in flight before compute).
    assert gathers[1] == gathers[0] - 2, f"all-gathers in forward / in the prefetched forward: {gathers}"
    # Block-wise optimizers read a gradient's local piece directly (optim/blockwise.py flat_piece). A pair
    # planned for Shampoo (made before its first forward): each panel on one rank, so no gather waits for
    # the reduce-scatter first. Last: Dynamo may serve the models above with these models' graphs.
    planned = _pair()
    _train("Shampoo, planned for it", rank, planned, _shampoo, {"step": _step}, steps=2)
    # The option changed the graph: the first bucket's gradient leaves it unreduced; explain() says so.
    assert buffers_of(models[0])[0].deferred is not None and buffers_of(models[1])[0].deferred is None
    plans = [fsdp_pass.explain(m, print_output=False).plan_text() for m in models]
    assert "across the step: bucket 0's reduce-scatter leaves backward in flight" in plans[0], plans[0]
    assert "step_reduced_first" in plans[0] and "issues the all-gathers of buckets 0, 1" in plans[0], plans[0]
    assert "across the step" not in plans[1], plans[1]


def test_last_reduce_scatter_in_flight_into_the_step_is_bitwise_the_same():
    run_distributed(_cases, 2)
