"""The step-time benchmark's measurement rules (``benchmarks/_measure.py``, ``benchmarks/_round_robin.py``) on
hand-built inputs, no processes.

``graph_copy_bytes``: which copies on a collective's data path a graph pays for, under Inductor and
aot_eager. ``per_collective``: how profiler events become one row per collective.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.fx as fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _measure as M  # noqa: E402
import _round_robin as RR  # noqa: E402

from fsdp_pass.buckets.matmul_into import matmul_into  # noqa: E402

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKET = 64  # elements of the gradient bucket


def _node(g: fx.Graph, target, args, shape) -> fx.Node:
    n = g.call_function(target, args)
    n.meta["val"] = torch.empty(shape, device="meta")
    return n


def _input(g: fx.Graph, name: str, shape) -> fx.Node:
    n = g.placeholder(name)
    n.meta["val"] = torch.empty(shape, device="meta")
    return n


def _bucket_graph(reach_collective: bool = True) -> fx.GraphModule:
    """A backward graph filling one gradient bucket: a matmul written in place (16 elements), then
    ``copy_`` into slices from a matmul (8), a reduction (8), a pointwise op (16) and a constant (16)."""
    g = fx.Graph()
    a, b = _input(g, "a", [4, 2]), _input(g, "b", [2, 4])
    x, y = _input(g, "x", [16]), _input(g, "y", [3, 8])
    buf = _node(g, aten.empty.memory_format, ([BUCKET],), [BUCKET])
    g.call_function(matmul_into._opoverload, (buf, 0, a, b, [], []))
    sources = [
        _node(g, aten.view.default, (_node(g, aten.mm.default, (b, a), [2, 2]), [4]), [4]),
        _node(g, aten.sum.dim_IntList, (y, [0]), [8]),
        _node(g, aten.mul.Tensor, (x, 2.0), [16]),
        _node(g, aten.full.default, ([16], 0.0), [16]),
    ]
    start = 16
    for src in sources:
        numel = src.meta["val"].numel()
        dst = _node(g, aten.slice.Tensor, (buf, 0, start, start + numel), [numel])
        _node(g, aten.copy_.default, (dst, src), [numel])
        start += numel
    out = buf
    if reach_collective:
        rs = _node(g, c10d.reduce_scatter_tensor.default, (buf, "sum", 2, "0"), [BUCKET // 2])
        out = _node(g, c10d.wait_tensor.default, (rs,), [BUCKET // 2])
    g.output((out,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_copy_into_bucket_inductor_counts_extern_and_reduction_sources():
    got = M.graph_copy_bytes(_bucket_graph(), inductor=True)
    assert got["bytes"] == (4 + 8) * 4  # the matmul's and the reduction's outputs; pointwise and constant fuse
    assert got["ops"] == {"aten.copy_": 4}  # matmul_into is no copy


def test_copy_into_bucket_aot_eager_counts_every_source():
    assert M.graph_copy_bytes(_bucket_graph(), inductor=False)["bytes"] == (4 + 8 + 16 + 16) * 4


def test_copy_into_buffer_off_the_collective_path_is_free():
    assert M.graph_copy_bytes(_bucket_graph(reach_collective=False), inductor=False) == {"bytes": 0, "ops": {}}


def test_copy_into_graph_input_is_an_input_mutation():
    g = fx.Graph()
    shard, x = _input(g, "shard", [8]), _input(g, "x", [8])
    _node(g, aten.copy_.default, (shard, _node(g, aten.mul.Tensor, (x, 2.0), [8])), [8])
    ag = _node(g, c10d.all_gather_into_tensor.default, (shard, 2, "0"), [16])
    g.output((_node(g, c10d.wait_tensor.default, (ag,), [16]),))
    assert M.graph_copy_bytes(fx.GraphModule(torch.nn.Module(), g), inductor=False)["bytes"] == 0


def test_cat_before_reduce_scatter_inductor_counts_extern_inputs_only():
    g = fx.Graph()
    a, b, x = _input(g, "a", [4, 2]), _input(g, "b", [2, 4]), _input(g, "x", [16])
    mm = _node(g, aten.view.default, (_node(g, aten.mm.default, (a, b), [4, 4]), [16]), [16])
    cat = _node(g, aten.cat.default, ([mm, _node(g, aten.mul.Tensor, (x, 2.0), [16])],), [32])
    rs = _node(g, c10d.reduce_scatter_tensor.default, (cat, "sum", 2, "0"), [16])
    g.output((_node(g, c10d.wait_tensor.default, (rs,), [16]),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert M.graph_copy_bytes(gm, inductor=True)["bytes"] == 16 * 4
    assert M.graph_copy_bytes(gm, inductor=False)["bytes"] == 32 * 4


def test_per_collective_pairs_issue_transfer_and_wait():
    """Two all-gathers issued back to back (the second a prefetch), one reduce-scatter; times in us."""
    ag, rs = "_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor"
    calls = [M.Call(ag, 100, 2, 0, 10), M.Call(ag, 50, 2, 20, 30), M.Call(M._WAIT, 200, 1, 40, 1040),
             M.Call(M._WAIT, 100, 1, 3000, 3010), M.Call(rs, 200, 2, 5000, 5010), M.Call(M._WAIT, 100, 1, 9000, 9500)]
    transfers = [M.Transfer("gloo:all_gather", 50, 35, 2035), M.Transfer("gloo:all_gather", 100, 15, 1015),
                 M.Transfer("gloo:all_reduce", 200, 5020, 9020)]
    compute = [(1100, 2900), (5100, 8900)]
    phases = [("forward", 0, 4000), ("backward", 4000, 10000)]
    rows = M.per_collective(calls, transfers, compute, phases, t0=0)
    assert [(r["name"], r["phase"], r["bytes"]) for r in rows] == [
        ("AG0", "forward", 800), ("AG1", "forward", 400), ("RS0", "backward", 800)]
    first, second, scatter = rows
    assert (first["call_ms"], first["transfer_ms"], first["hidden_ms"], first["wait_ms"]) == (0.01, 1.0, 0.0, 1.0)
    assert (second["hidden_ms"], second["exposed_ms"], second["window_ms"]) == (0.935, 1.065, 2.98)
    assert (scatter["hidden_ms"], scatter["exposed_ms"]) == (3.8, 0.2)
    assert M.first_and_last(rows) == {"first_ag": "AG0", "first_ag_exposed_ms": 1.0,
                                      "last_rs": "RS0", "last_rs_exposed_ms": 0.2}


def test_round_robin_compares_round_by_round():
    """A step is timed on its slowest rank; a round's time is its fastest step; systems compare per round."""
    ranks = [{"a": {"rounds": [[1.0, 0.5, 0.9], [2.0, 3.0, 2.5]]}, "b": {"rounds": [[1.1, 1.0, 1.2], [2.0, 2.0, 2.0]]}},
             {"a": {"rounds": [[0.8, 0.7, 0.6], [2.2, 1.0, 3.0]]}, "b": {"rounds": [[1.0, 0.9, 1.3], [4.0, 2.2, 1.0]]}}]
    a, b = RR.round_times(ranks, "a"), RR.round_times(ranks, "b")
    assert a == [0.7, 2.2] and b == [1.0, 2.0]  # min over steps of max over ranks
    summary = RR.ratio_summary(RR.per_round_ratios(a, b))
    assert summary["ratios"] == [0.7 / 1.0, 2.2 / 2.0] and summary["no_slower"] == 1 and summary["rounds"] == 2
    assert RR.ratio_summary([1.0, 1.0, 1.2])["no_slower"] == 2  # as fast counts as no slower
    steady, noisy = RR.ratio_summary([0.9, 0.92, 0.88, 0.9]), RR.ratio_summary([0.6, 1.2, 0.9, 0.95])
    assert abs(steady["geo_mean"] - 0.8999) < 1e-3 and steady["ci95"][1] < 0.95  # resolves a 10% gain
    assert noisy["ci95"][0] < 1.0 < noisy["ci95"][1]  # about the same mean, not resolved
