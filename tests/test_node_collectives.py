"""Collectives in two levels across nodes ([Note: collectives in two levels across nodes]): 4 ranks told by
the launcher's variables that they are 2 nodes of 2, one process group running every case. Bytes across a
real link are measured by tests/test_node_lab.py and benchmarks/node_link.py."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

import fsdp_pass
from fsdp_pass.buckets.dbuffer import buffers_of
from fsdp_pass.buckets.mesh import ShardingMesh
from fsdp_pass.buckets.node_collectives import (all_gather_in_two_levels, make_node_levels,
                                                reduce_scatter_in_two_levels)
from fsdp_pass.compile.backend import records
from fsdp_pass.testing.collectives import quantized_exchanges_overlap
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss
from fsdp_pass.testing.spawn import run_distributed

from parity import Case, run_case

_c10d = torch.ops._c10d_functional
pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release


def _as_nodes(nodes: list[int], rank: int) -> None:
    """What torchrun sets on a rank of node ``nodes[rank]``."""
    os.environ["GROUP_RANK"] = str(nodes[rank])
    os.environ["LOCAL_WORLD_SIZE"] = str(nodes.count(nodes[rank]))


def _collectives(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    levels = make_node_levels(mesh, 0)
    flat = mesh.get_group(0).group_name
    resolve = dist.distributed_c10d._resolve_process_group
    assert (levels.nodes, levels.per_node) == (2, 2)
    assert dist.get_process_group_ranks(resolve(levels.within)) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(resolve(levels.across)) == [rank % 2, rank % 2 + 2]

    torch.manual_seed(rank)
    shard, grad = torch.randn(7), torch.randn(world * 7) * torch.logspace(-3, 3, world * 7)
    gathered = all_gather_in_two_levels(shard, levels)
    assert torch.equal(gathered, _c10d.wait_tensor(_c10d.all_gather_into_tensor(shard, world, flat)))
    every = [torch.empty(world * 7) for _ in range(world)]
    dist.all_gather(every, grad)
    exact = torch.stack(every).double().sum(0)[rank * 7:(rank + 1) * 7]
    reduced = reduce_scatter_in_two_levels(grad, levels)
    assert torch.allclose(reduced.double(), exact, rtol=1e-6, atol=1e-6)


def _layouts(rank: int, world: int) -> None:
    """Layouts that stay in one step: interleaved nodes, one node, one rank per node, HSDP within nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    for nodes in ([0, 1, 0, 1], [0, 0, 0, 0], [0, 1, 2, 3]):
        _as_nodes(nodes, rank)
        assert make_node_levels(init_device_mesh("cpu", (world,)), 0) is None, nodes
    _as_nodes([0, 0, 1, 1], rank)
    assert make_node_levels(init_device_mesh("cpu", (2, 2)), 1) is None  # shard dim inside a node
    assert make_node_levels(init_device_mesh("cpu", (2, 2)), 0) is None  # one rank per node


def _llama_case(name: str, options: dict, tolerance: float) -> Case:
    return Case(name, lambda: init_std(Llama(LlamaConfig(layers=2))),
                lambda step, b: (t := torch.randint(0, 61, (b, 8), generator=torch.Generator().manual_seed(step)), t),
                lm_loss, steps=3, options={"compiler": "aot_eager", "min_bucket_bytes": 0, **options},
                tolerance=tolerance)


def _gather_groups() -> set[str]:
    """The process groups the all-gathers of the last compiled graph run on."""
    return {node.args[2] for gm in records()[-1].modules.values()
            for node in gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)}


def _training(rank: int, world: int) -> None:
    """Training matches one process with the two-level collectives in the compiled graphs."""
    from torch.distributed.device_mesh import init_device_mesh

    _as_nodes([0, 0, 1, 1], rank)
    mesh = init_device_mesh("cpu", (world,))
    for case in (_llama_case("two levels", {}, 1e-5),
                 _llama_case("two levels, backward gathers within the node", {"reshard_after_forward": 2}, 1e-5),
                 _llama_case("two levels, last reduce at the optimizer step", {"overlap_last_reduce": True}, 1e-5),
                 _llama_case("two levels, next step's first gather at the optimizer step",
                             {"prefetch_next_step": True}, 1e-5)):
        run_case(case, rank, world, mesh)
        levels, groups = ShardingMesh(mesh, 0).node_levels(), _gather_groups()
        assert {levels.across, levels.within} <= groups and mesh.get_group(0).group_name not in groups, (case.name,
                                                                                                       groups)

    # turned off: one step over the shard group
    run_case(_llama_case("two levels turned off", {"two_level_collectives": False}, 1e-5), rank, world, mesh)
    levels, groups = ShardingMesh(mesh, 0).node_levels(), _gather_groups()
    assert mesh.get_group(0).group_name in groups and not {levels.across, levels.within} & groups, groups
    model = fsdp_pass.fully_shard(init_std(Llama(LlamaConfig(layers=1))), mesh, two_level_collectives=False)
    assert all(b.mesh.node_levels() is None for b in buffers_of(model))

    # quantized: only the node sums cross, int8; error within the bound of the one-step form
    result = run_case(_llama_case("two levels, quantized", {"quantized_reduce": {"block": 32}}, 0.05), rank, world,
                      mesh)
    backward = "\n".join(code for stage, code in records()[-1].graphs.items() if stage.startswith("backward"))
    assert "reduce_scatter_tensor" in backward and "all_to_all_single" in backward
    # the exchange across the nodes overlaps the next bucket's compute; the fast within-node step does not
    assert quantized_exchanges_overlap(records()[-1].modules["backward"].graph)
    assert result["param_rel"] > 0
    explanation = fsdp_pass.explain(result["model"], print_output=False)
    plan = explanation.plan_text()
    listed = re.search(r"collectives in two levels: buckets \[([\d, ]+)\] span 2 nodes of 2 ranks", plan)
    assert listed and sorted(map(int, listed[1].split(", "))) == sorted(b.index for b in explanation.buffers), plan
    assert "one all_to_all across the nodes, of the node's exact sums" in plan, plan


def _cases(rank: int, world: int) -> None:
    _as_nodes([0, 0, 1, 1], rank)
    _collectives(rank, world)
    _training(rank, world)
    _layouts(rank, world)


@pytest.mark.timeout(600)
def test_two_level_collectives_on_two_nodes_of_two():
    run_distributed(_cases, 4, timeout=540)


def _stages(rank: int, world: int) -> tuple:
    """Two pipeline stages of 4 ranks on 4 nodes of 2, each sharding over its sub-mesh: every rank of the
    world makes every stage's groups (two-level, and reshard_after_forward=2's) in one order ([Note: every
    rank makes every group]), the second stage after work of its own in its stage."""
    from torch.distributed.device_mesh import init_device_mesh

    _as_nodes([0, 0, 1, 1, 2, 2, 3, 3], rank)
    shard_mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))["dp"]
    if rank // 4 == 1:
        dist.all_reduce(torch.ones(1), group=shard_mesh.get_group(0))
    sharding = ShardingMesh(shard_mesh, 0)
    levels = sharding.node_levels()
    gathered = all_gather_in_two_levels(torch.full((3,), float(rank)), levels)
    reshard = sharding.node_group(2)
    resolve = dist.distributed_c10d._resolve_process_group
    return (gathered[::3].tolist(), dist.get_process_group_ranks(resolve(levels.across)),
            dist.get_process_group_ranks(resolve(levels.within)),
            dist.get_process_group_ranks(resolve(reshard.group_name)))


@pytest.mark.timeout(120)
def test_pipeline_stages_make_each_others_node_groups():
    results = run_distributed(_stages, 8, timeout=90)
    for rank, (gathered, across, within, reshard) in enumerate(results):
        first = rank // 4 * 4
        assert gathered == [float(first + k) for k in range(4)]
        assert across == [first + rank % 2, first + rank % 2 + 2]
        assert within == reshard == [rank // 2 * 2, rank // 2 * 2 + 1]
