"""The overlap schedule on compiled graphs: prefetch, early reduce-scatter, late waits, in-flight bound."""

from __future__ import annotations

import re
from typing import Callable

import pytest
import torch
import torch.fx as fx

import fsdp_pass.buckets.matmul_into  # noqa: F401  (registers torch.ops.fsdp_pass.matmul_into)
from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.compile.backend import records
from fsdp_pass.testing.models import MLP, Llama, LlamaConfig, init_std, lm_loss

_c10d = torch.ops._c10d_functional
# Matmuls; in backward graphs weight gradients are matmuls written into the bucket gradient
# ([Note: gradients written into the bucket]).
_COMPUTE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.fsdp_pass.matmul_into.default}


def _position(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _nodes(gm: fx.GraphModule, op) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=op))


def _first_compute_after(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    pos = _position(gm)
    return min((n for n in gm.graph.nodes if n.target in _COMPUTE and pos[n] > pos[node]), key=pos.__getitem__)


def _wait(node: fx.Node) -> fx.Node:
    return next(u for u in node.users if u.target is _c10d.wait_tensor.default)


def _check_forward(fw: fx.GraphModule) -> None:
    pos = _position(fw)
    gathers = _nodes(fw, _c10d.all_gather_into_tensor.default)
    assert len(gathers) == 3
    for k in range(len(gathers) - 1):
        compute_k = _first_compute_after(fw, _wait(gathers[k]))  # bucket k's first matmul
        assert pos[gathers[k + 1]] < pos[compute_k], f"all_gather {k + 1} is not issued before bucket {k}'s compute"


def _max_in_flight(gm: fx.GraphModule, weigh: Callable[[fx.Node], int] = lambda node: 1) -> int:
    """Most of ``weigh(collective)``, summed over the collectives issued and not yet waited on, at any
    point of the graph order (by default: how many; on CPU (gloo) one, [Note: one collective in
    flight on gloo])."""
    in_flight, worst = {}, 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is _c10d.wait_tensor.default:
            in_flight.pop(node.args[0], None)
        elif node.target.namespace == "_c10d_functional":
            in_flight[node] = weigh(node)
        worst = max(worst, sum(in_flight.values()))
    return worst


def _gathered_bytes(node: fx.Node) -> int:
    """Bytes of the bucket an all_gather gathers (0 for other collectives)."""
    if node.target is not _c10d.all_gather_into_tensor.default:
        return 0
    return node.meta["val"].numel() * node.meta["val"].element_size()


def _check_backward(bw: fx.GraphModule) -> None:
    pos = _position(bw)
    scatters = _nodes(bw, _c10d.reduce_scatter_tensor.default)
    assert len(scatters) == 3
    for k in range(len(scatters) - 1):
        # bucket k's reduce_scatter is in flight during bucket k+1's backward matmuls
        compute_next = _first_compute_after(bw, scatters[k])
        assert pos[compute_next] < pos[_wait(scatters[k])] < pos[scatters[k + 1]]


def _check_first_backward_gather(bw: fx.GraphModule) -> None:
    """Resharded after forward, the first bucket is gathered again before any backward compute runs:
    the output layer's weight-gradient matmul, first in a llama's backward, does not read it and hides it."""
    pos = _position(bw)
    gathers = _nodes(bw, _c10d.all_gather_into_tensor.default)
    first_compute = min(pos[n] for n in bw.graph.nodes if n.target in _COMPUTE)
    assert gathers and pos[gathers[0]] < first_compute, "the backward's first all_gather waits behind compute"


def _schedule_worker(rank: int, world: int, compiler: str) -> None:
    torch._dynamo.reset()
    before = set(map(id, records()))
    compiled = torch.compile(MLP(), backend="vescale", options={"compiler": compiler, "min_bucket_bytes": 0})
    compiled(torch.randn(4, 19)).sum().backward()
    (record,) = [r for r in records() if id(r) not in before]
    _check_forward(record.modules["forward"])
    _check_backward(record.modules["backward"])
    for stage in ("forward", "backward"):
        assert _max_in_flight(record.modules[stage]) == 1, stage
    if compiler == "inductor":
        # Inductor keeps the order: the second all_gather is issued after the first one's wait and
        # before the first addmm runs.
        code = record.graphs["forward (inductor code)"]
        calls = re.findall(r"^\s*(?:\w+ = )?(?:torch\.ops\._c10d_functional\.)?(all_gather_into_tensor|wait_tensor|"
                           r"extern_kernels\.addmm)(?:\.default)?\(", code, re.M)
        assert calls[:4] == ["all_gather_into_tensor", "wait_tensor", "all_gather_into_tensor",
                             "extern_kernels.addmm"], calls
        for stage in ("forward", "backward"):  # and it keeps one collective in flight on CPU
            ops = re.findall(r"_c10d_functional\.(\w+?)(?:\.default)?\(", record.graphs[f"{stage} (inductor code)"])
            issued = [op != "wait_tensor" for op in ops]
            assert len(ops) >= 4 and all(issued[::2]) and not any(issued[1::2]), (stage, ops)

    torch._dynamo.reset()
    before = set(map(id, records()))
    model = init_std(Llama(LlamaConfig(layers=1)))
    tokens = torch.randint(0, 61, (2, 8))
    lm_loss(torch.compile(model, backend="vescale", options={"compiler": compiler})(tokens), tokens).backward()
    (record,) = [r for r in records() if id(r) not in before]
    _check_first_backward_gather(record.modules["backward"])
    for stage in ("forward", "backward"):
        assert _max_in_flight(record.modules[stage]) == 1, stage

    # A bound below two buckets disables prefetch wherever it would exceed it.
    torch._dynamo.reset()
    before = set(map(id, records()))
    bound = 880 * 4  # bytes of the largest bucket (37x23 + 23 + padding, fp32): one bucket at a time
    compiled = torch.compile(MLP(), backend="vescale", options={"compiler": compiler, "max_inflight_bytes": bound,
                                                                     "min_bucket_bytes": 0})
    compiled(torch.randn(4, 19)).sum().backward()
    (record,) = [r for r in records() if id(r) not in before]
    for stage in ("forward", "backward"):
        assert _max_in_flight(record.modules[stage], _gathered_bytes) <= bound


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_overlap_schedule(compiler):
    run_distributed(_schedule_worker, 2, compiler)
