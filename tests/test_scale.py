"""Scale: the backend's passes on a Dynamo graph of full-width Llama-3-70B layers at 16384 fake ranks.

Runs the code path of ``benchmarks/scale.py`` (meta-device model, Dynamo capture, detect → shard →
rewrite under a single-process fake process group) on the embedding, 2 layers and head of
Llama-3-70B, and checks the rewritten graph and the per-rank sizes against the model.
"""

from __future__ import annotations

import importlib.util
import math
import operator
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_pass import RaggedShardTensor
from fsdp_pass.testing.fake_pg import fake_process_group
from fsdp_pass.plan.model_configs import model_units
from fsdp_pass.buckets.gather import gather_bucket

WORLD = 16384


def _load_benchmark():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "scale.py"
    spec = importlib.util.spec_from_file_location("scale_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load_benchmark()


@pytest.fixture(scope="module")
def two_layers(bench):
    model = bench.build("llama3-70b", layers=2)
    return model, bench.capture(model)


def test_two_llama3_70b_layers_at_16384_ranks(bench, two_layers):
    model, captured = two_layers
    expected = {name: shape for unit, params in model_units("llama3-70b")
                if unit in ("embed", "head", "layer0", "layer1") for name, shape in params}
    total = sum(math.prod(shape) for shape in expected.values())
    options = {"mp_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}}
    with fake_process_group(WORLD):
        result = bench.timed_passes(captured, dict(options, mesh=init_device_mesh("cpu", (WORLD,))))
        rewritten, sites, memory, checks = result["rewritten"], result["sites"], result["memory"], result["checks"]
        buffers = rewritten.buffers
        graph = rewritten.gm.graph
        graph.lint()

        # Every parameter of the graph, by its module name, swapped into a RaggedShard parameter over 16384 ranks;
        # the model the graph was traced from keeps its own meta parameters.
        assert {s.name: tuple(s.param.shape) for s in sites} == expected
        assert all(isinstance(s.param, RaggedShardTensor) and s.param.placement.world_size == WORLD for s in sites)
        assert all(p.is_meta and not isinstance(p, RaggedShardTensor) for p in model.parameters())

        # One bucket per unit (embedding, 2 layers, head), one gather per bucket, fed by that bucket's shard input.
        assert len(buffers) == 4 and checks["buckets"] == checks["gathers"] == 4 and checks["one_gather_per_bucket"]
        gathers = list(graph.find_nodes(op="call_function", target=gather_bucket))
        placeholders = list(graph.find_nodes(op="placeholder"))
        assert [p.name for p in placeholders[:4]] == [f"bucket{i}_shard" for i in range(4)]
        assert sorted(g.args[0].name for g in gathers) == [f"bucket{i}_shard" for i in range(4)]
        # No parameter placeholder is left: the inputs are the 4 shards and the tokens.
        assert len(placeholders) == 5 and checks["parameter_placeholders_left"] == 0
        # Each gather is split into its bucket's segments (padding included), and each parameter is one view.
        for g, buf in zip(sorted(gathers, key=lambda g: g.args[0].name), buffers):
            (split,) = g.users
            assert split.args[1] == buf.segment_sizes()
            views = {tuple(v.args[1]) for item in split.users for v in item.users if item.target is operator.getitem}
            assert views == {tuple(buf.shapes[n]) for n in buf.names}
            assert sum(buf.segment_sizes()) == buf.layout.shard_size * WORLD
        assert checks["parameter_views"] == len(expected)

        # Per-rank sizes: every rank holds S elements of each bucket; S * ranks = parameters + padding.
        per_rank = sum(b.layout.shard_size for b in buffers)
        padding = sum(b.layout.padding for b in buffers)
        assert memory["elements"] == total == sum(b.layout.numel for b in buffers)
        assert per_rank * WORLD == total + padding == memory["shard_elements"] * WORLD
        assert memory["params"] == memory["grads"] == per_rank * 4  # fp32 master shards and gradients
        # With element blocks the planner reaches the lower bound: S = ceil(numel / ranks) rounded up to
        # 8 elements (16 bytes of bf16), so padding is under 8 elements per rank per bucket.
        assert all(b.layout.shard_size == b.layout.lower_bound and b.layout.align == 8 for b in buffers)
        assert padding < 4 * 8 * WORLD
        # AdamW: two fp32 states over the busiest rank's real elements, at most the padded shard.
        assert 2 * 4 * (per_rank - padding) <= memory["adamw"] <= 2 * memory["params"]
        # Largest gathered bucket: the embedding or the head (128256 x 8192), in bf16.
        assert memory["largest_gathered_bucket"] == max(b.layout.global_size for b in buffers) * 2
        assert max(b.layout.global_size for b in buffers) >= 128256 * 8192
        for b in buffers:
            b.layout.validate()


def test_deepseek_v3_dense_and_moe_layers_at_4096_ranks(bench):
    """MLA attention, the 3 dense layers and one MoE layer (256 experts + shared + router): 821 tensors."""
    model = bench.build("deepseek-v3", layers=4)
    captured = bench.capture(model)
    total = sum(p.numel() for p in model.parameters())
    with fake_process_group(4096):
        result = bench.timed_passes(captured, {"mesh": init_device_mesh("cpu", (4096,))})
    checks, memory = result["checks"], result["memory"]
    assert checks["parameters"] == 821 == len(list(model.parameters()))
    assert checks["one_gather_per_bucket"] and checks["buckets"] == 6  # embedding, 4 layers, head
    assert checks["parameter_placeholders_left"] == 0 and checks["parameter_views"] == 821
    assert memory["elements"] == total
    assert memory["shard_elements"] * 4096 == total + memory["padding_elements"]
    assert memory["params"] == memory["grads"] == memory["shard_elements"] * 4  # fp32, no mixed precision
    # The MoE layer (11.3B elements) is the largest bucket, gathered in fp32 here.
    assert memory["largest_gathered_bucket"] == 4 * max(b.layout.global_size for b in result["rewritten"].buffers)
    assert memory["largest_gathered_bucket"] > 256 * 3 * 2048 * 7168 * 4
