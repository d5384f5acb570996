"""``python -m fsdp_pass``: the offline planner (``plan``) and the graph viewer (``explain``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_pass.plan.cli import main
from fsdp_pass.sharding.blocks import block_elements
from fsdp_pass.plan.report import plan_model
from fsdp_pass.testing.fake_pg import fake_process_group
from fsdp_pass.plan.model_configs import build_meta_model, load_model, total_params
from fsdp_pass.sharding.buckets import ShardingConfig
from fsdp_pass.sharding.materialize import shard_parameters
from fsdp_pass.sharding.mesh_roles import resolve_mesh


class Tiny(nn.Module):
    """A user model for ``--model test_cli:tiny_model``: two repeated blocks, a top-level head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(24, 24) for _ in range(2))
        self.head = nn.Linear(24, 10, bias=False)


def tiny_model() -> nn.Module:
    return Tiny()


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m fsdp_pass ARGS`` in a fresh process, as a user would (and away from this one's state)."""
    result = subprocess.run([sys.executable, "-m", "fsdp_pass", *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result


def test_plan_llama3_70b_at_16384_ranks_within_a_minute():
    started = time.perf_counter()
    out = json.loads(_cli("plan", "--model", "llama3-70b", "--world-size", "16384", "--json").stdout)
    elapsed = time.perf_counter() - started
    assert elapsed < 60, f"plan took {elapsed:.1f} s"
    for key in ("model", "world_size", "mesh_shape", "params", "padding", "buckets", "per_rank_bytes",
                "comm_bytes_per_rank", "seconds"):
        assert key in out
    assert set(out["per_rank_bytes"]) == {"params", "grads", "optimizer", "gathered_peak", "kept_after_forward", "total"}
    m, total, padding = 16384, total_params("llama3-70b"), out["padding"]["elements"]
    assert out["params"] == total
    assert (total + padding) % m == 0
    assert out["per_rank_bytes"]["params"] == (total + padding) // m * torch.bfloat16.itemsize
    assert out["buckets"]["count"] == 83  # 80 layers + embeddings, final norm, output head
    # Ring all-gather: each rank sends (m-1)/m of the gathered model.
    assert out["comm_bytes_per_rank"]["all_gather_forward"] == (m - 1) * out["per_rank_bytes"]["params"]


def test_plan_what_if_reshard_after_forward_within_nodes(capsys):
    """reshard_after_forward=8 at 16384 ranks: backward's all-gathers stay inside nodes of 8, each moving 7
    pieces of bucket / 8; forward and the reduce-scatter are the True run's; each rank keeps bucket / 8."""
    runs = {}
    for flags in ([], ["--reshard-after-forward", "8"], ["--no-reshard-after-forward"]):
        assert main(["plan", "--model", "llama3-8b", "--world-size", "16384", "--node-size", "8", "--json", *flags]) == 0
        runs[tuple(flags)] = json.loads(capsys.readouterr().out)
    true, k, false = runs.values()
    link = lambda out, name: out["comm_bytes_by_link"][name]  # noqa: E731
    assert link(k, "all_gather_backward")["across_nodes"] == 0
    assert link(true, "all_gather_backward")["across_nodes"] > 0
    assert link(k, "all_gather_forward") == link(true, "all_gather_forward")
    assert link(k, "reduce_scatter") == link(true, "reduce_scatter")
    kept_false = false["per_rank_bytes"]["kept_after_forward"]
    assert true["per_rank_bytes"]["kept_after_forward"] == 0
    assert k["per_rank_bytes"]["kept_after_forward"] == kept_false // 8
    assert link(k, "all_gather_backward")["inside_node"] == pytest.approx(7 * kept_false / 8, rel=1e-6)
    with pytest.raises(SystemExit, match=r"--reshard-after-forward=3 does not cut the shard dim of 16384 ranks"):
        main(["plan", "--model", "llama3-8b", "--world-size", "16384", "--reshard-after-forward", "3"])


def test_plan_what_if_quantized_reduce(capsys):
    """int8 codes + a fp32 scale per 128 elements: across nodes, 1/4 of the fp32 reduce-scatter bytes plus the
    scales; within a node the node's sums stay fp32 ([Note: collectives in two levels across nodes])."""
    runs = []
    for flags in ([], ["--quantized-reduce", "int8"]):
        assert main(["plan", "--model", "llama3-8b", "--world-size", "1024", "--reduce-dtype", "fp32", "--json",
                     *flags]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    plain, quantized = (run["comm_bytes_by_link"]["reduce_scatter"] for run in runs)
    ratio = quantized["across_nodes"] / plain["across_nodes"]
    assert 0.25 < ratio <= 0.25 + 1 / 128 + 1e-3, ratio
    assert quantized["inside_node"] == plain["inside_node"] > 0
    # 128 nodes of 8: each rank takes 127 pieces from other nodes and 7 x 128 from its own
    assert plain["inside_node"] == pytest.approx(7 * 128 / 127 * plain["across_nodes"], rel=1e-6)
    assert runs[1]["comm_bytes_per_rank"]["all_gather_forward"] == runs[0]["comm_bytes_per_rank"]["all_gather_forward"]


@pytest.mark.parametrize("model,flag", [("llama3-70b", "--tp"), ("gpt-oss-120b", "--ep")])
def test_plan_composed_with_tensor_or_expert_parallelism_at_16384_ranks(model, flag):
    """TP/EP split a parameter first, FSDP shards what is left: every rank still holds 1/16384 (+ padding)."""
    out = json.loads(_cli("plan", "--model", model, "--world-size", "16384", flag, "8", "--json").stdout)
    plain = json.loads(_cli("plan", "--model", model, "--world-size", "16384", "--json").stdout)
    total, padding = total_params(model), out["padding"]["elements"]
    assert (out["world_size"], out["tp" if flag == "--tp" else "ep"]) == (16384, 8)
    assert out["params"] == total
    assert out["per_rank_bytes"]["params"] == (total + padding) // 16384 * torch.bfloat16.itemsize
    assert padding <= 0.01 * total
    # The split tensors are gathered over 2048 ranks instead of 16384: less all_gather traffic per rank.
    assert out["comm_bytes_per_rank"]["all_gather_forward"] < plain["comm_bytes_per_rank"]["all_gather_forward"]


def test_plan_deals_per_expert_modules_out_to_expert_parallel_ranks():
    """DeepSeek-V3's 256 experts per layer are separate modules: each of 8 EP ranks holds 32 of them."""
    out = json.loads(_cli("plan", "--model", "deepseek-v3", "--world-size", "16384", "--ep", "8",
                          "--bucket-size", "1e9", "--json").stdout)
    total, padding = total_params("deepseek-v3"), out["padding"]["elements"]
    assert out["params"] == total
    assert out["per_rank_bytes"]["params"] == (total + padding) // 16384 * torch.bfloat16.itemsize


def test_plan_hsdp_shards_over_the_last_mesh_dim():
    out = plan_model(build_meta_model("llama3-8b"), (2, 64)).to_dict()
    assert (out["shard_size"], out["replicate_size"], out["world_size"]) == (64, 2, 128)
    total, padding = total_params("llama3-8b"), out["padding"]["elements"]
    assert out["per_rank_bytes"]["params"] == (total + padding) // 64 * 2
    # Ring all-reduce of the gradient shard over 2 replicas sends 2 * (2-1)/2 of it.
    assert out["comm_bytes_per_rank"]["all_reduce_replicas"] == out["per_rank_bytes"]["grads"]


def test_plan_of_a_user_module_factory(capsys):
    # This file is importable as ``test_cli`` (conftest puts tests/ on sys.path), as a user's module would be.
    assert main(["plan", "--model", "test_cli:tiny_model", "--world-size", "4", "--param-dtype", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == sum(p.numel() for p in Tiny().parameters())
    assert out["buckets"]["count"] == 3  # blocks.0, blocks.1, head
    assert [b["copies"] for b in out["buckets"]["distinct"]] == [2, 1]
    assert out["per_rank_bytes"]["params"] == (out["params"] + out["padding"]["elements"]) // 4 * 4


def test_plan_text_output_names_every_section(capsys):
    assert main(["plan", "--model", "llama3-8b", "--world-size", "256", "--block-policy", "16row"]) == 0
    text = capsys.readouterr().out
    for line in ("parameters", "padding", "buckets", "per-rank memory", "optimizer", "gathered (peak)",
                 "communication per step", "reduce_scatter", "planned in"):
        assert line in text


def test_explain_prints_the_rewritten_and_compiled_graphs():
    out = _cli("explain", "--world-size", "2").stdout
    assert "all_gather_into_tensor" in out
    assert "reduce_scatter_tensor" in out
    for stage in ("rewritten", "forward", "backward"):
        assert f": {stage} =====" in out


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "plan" in text and "explain" in text
    for command in ("plan", "explain"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        assert "--world-size" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "llama3-8b", "--world-size", "8", "--mesh-shape", "2x8"], "covers 16 ranks"),
    (["plan", "--model", "llama3-9b", "--world-size", "8"], "unknown model"),
    (["plan", "--model", "no_such_module:factory", "--world-size", "8"], "cannot load"),
])
def test_plan_errors_say_what_to_fix(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_planning_repeated_units_once_matches_sharding_the_whole_model():
    """plan_model shards one copy of each distinct unit; the buckets must be those of the full model."""
    summary = plan_model(build_meta_model("llama3-8b"), (2, 32), bucket_size=200_000_000, block_rows=16)
    planned = Counter()
    for b in summary.buckets:
        planned[(b.tensors, b.numel, b.shard_size)] += b.copies

    named = list(build_meta_model("llama3-8b").named_parameters())
    blocks = {n: block_elements(tuple(p.shape), 16) for n, p in named}
    with fake_process_group(64):
        mesh = resolve_mesh(init_device_mesh("cpu", (2, 32)))
        buffers = shard_parameters(named, mesh, ShardingConfig(200_000_000), blocks)
        full = Counter((len(b.names), b.layout.numel, b.layout.shard_size) for b in buffers)
    assert planned == full
    assert summary.params == total_params("llama3-8b")


def test_optimizer_state_covers_the_busiest_ranks_real_elements():
    """One 3-element tensor that must not be cut, on 2 ranks: S = 4 (fp32 alignment), rank 0 holds it all."""

    class Vector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.v = nn.Parameter(torch.empty(3))

    summary = plan_model(Vector(), (2,), block_rows=1, param_dtype=torch.float32)
    mem = summary.per_rank_bytes()
    assert mem["params"] == 4 * 4  # S = 4 elements, padding included
    assert mem["optimizer"] == 3 * 2 * 4  # AdamW: 2 fp32 states for each of rank 0's 3 elements
    assert mem["gathered_peak"] == 2 * 8 * 4


def test_block_elements_takes_the_largest_dividing_row_count():
    assert block_elements((2880, 4096), 128) == 120 * 4096  # 128 does not divide 2880 rows
    assert block_elements((128, 2880, 5760), 16) == 16 * 5760  # leading dims flattened into rows
    assert block_elements((64,), 128) == 64  # a 1-D tensor is one row
    assert block_elements((4096, 4096), 0) == 1


def test_load_model_builds_public_shapes_on_the_meta_device():
    model = load_model("llama3-70b")
    params = dict(model.named_parameters())
    assert params["layers.79.mlp.down_proj.weight"].shape == (8192, 28672)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params.values())
    assert sum(p.numel() for p in params.values()) == total_params("llama3-70b")


def test_plan_of_a_peft_model_names_units_as_named_parameters(capsys):
    pytest.importorskip("peft")
    assert main(["plan", "--model", "fsdp_pass.testing.third_party:tiny_lora_llama", "--world-size", "4",
                 "--json"]) == 0
    units = [b["units"] for b in json.loads(capsys.readouterr().out)["buckets"]["distinct"]]
    assert any(u.startswith("base_model.model.model.layers.0") for u in units), units
    assert not any("__dict__" in u for u in units), units
