"""The node lab ([Note: a node lab]): nodes as network namespaces joined by rate-limited links."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_pass.buckets.node_collectives import (all_gather_in_two_levels, make_node_levels,
                                                reduce_scatter_in_two_levels)
from fsdp_pass.testing import node_lab
from fsdp_pass.testing.node_lab import NodeLab, unavailable
from fsdp_pass.testing.spawn import run_distributed

LAB = unavailable()
needs_lab = pytest.mark.skipif(LAB is not None, reason=LAB or "")
RATE_MBIT = 200
PAYLOAD = 2 ** 21  # float32 elements: 8 MiB, 0.34 s at 200 Mbit/s
PIECE = 2 ** 16  # float32 elements per rank in the collectives: 256 KiB


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout


def _send_times(rank: int, world: int, lab: NodeLab) -> dict:
    """Rank 0 (node 0) sends PAYLOAD to rank 2 (node 1) across the link, then to rank 1 on its own node; then
    the bytes each node's link sends in gloo's collectives of PIECE elements per rank (each node's first rank
    reads its counter)."""
    from torch.distributed.device_mesh import init_device_mesh

    data = torch.ones(PAYLOAD)
    times = {}
    for peer, where in ((2, "across"), (1, "inside")):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(data, peer)
        elif rank == peer:
            dist.recv(data, 0)
        dist.barrier()
        times[where] = time.perf_counter() - start
    # a bucket's group in two levels ([Note: collectives in two levels across nodes]): the nodes torchrun reports
    levels = make_node_levels(init_device_mesh("cpu", (world,)), 0)
    collectives = {
        "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(PIECE * world), torch.ones(PIECE)),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(PIECE), torch.ones(PIECE * world)),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty(PIECE * world), torch.ones(PIECE * world)),
        "two_level_all_gather": lambda: all_gather_in_two_levels(torch.ones(PIECE), levels),
        "two_level_reduce_scatter": lambda: reduce_scatter_in_two_levels(torch.ones(PIECE * world), levels),
    }
    sent = {}
    for name, collective in collectives.items():
        dist.barrier()
        before = lab.sent_from_here(rank // 2)
        dist.barrier()  # no rank sends before every reader has its "before"
        collective()
        dist.barrier()
        sent[name] = lab.sent_from_here(rank // 2) - before
    return {"times": times, "env": (os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]),
            "ifname": os.environ["GLOO_SOCKET_IFNAME"], "sent": sent}


@needs_lab
def test_ranks_on_two_nodes_send_at_the_link_rate_and_the_counters_see_it():
    with NodeLab(2, RATE_MBIT) as lab:
        names = lab.namespaces + [lab.hub]
        assert all(n in _namespaces() for n in names)
        sent_before = lab.bytes_sent()
        results = run_distributed(_send_times, 4, lab, lab=lab, timeout=120, pg_timeout=60)
        sent = lab.bytes_sent() - sent_before
    assert [r["env"] for r in results] == [("2", "0"), ("2", "0"), ("2", "1"), ("2", "1")]
    assert [r["ifname"] for r in results] == [lab.devices[0]] * 2 + [lab.devices[1]] * 2
    across, inside = results[0]["times"]["across"], results[0]["times"]["inside"]
    payload = PAYLOAD * 4
    assert payload * 8 / across / 1e6 < RATE_MBIT * 1.1, f"{payload} bytes in {across:.3f} s: faster than the link"
    assert inside < across / 3, f"inside a node {inside:.3f} s, across {across:.3f} s: intra-node traffic is throttled"
    # the transfer across and the collectives, plus the group's setup and barriers (kilobytes); the intra-node
    # transfer stays off the link
    collectives = sum(results[0]["sent"].values()) + sum(results[2]["sent"].values())
    assert payload + collectives <= sent < (payload + collectives) * 1.05, f"{sent} bytes crossed for {payload}"
    # gloo's rings over ranks 0-1-2-3 cross between the nodes on 2 of their 4 edges ([Note: ring collectives
    # across nodes] in plan/report.py): an all-gather sends 3 pieces over each, a reduce-scatter (an all-reduce
    # of the whole input inside gloo) 2 * 3/4 * 4 pieces, an all-to-all 2 pieces from each rank
    # In two levels only the across-node step crosses: 2 rings of the 2 ranks with one place on their nodes,
    # 1 piece each way (the all-gather) or an all-reduce of 2 pieces (gloo's reduce-scatter)
    expected = {"all_gather": 6, "reduce_scatter": 12, "all_to_all": 8, "two_level_all_gather": 4,
                "two_level_reduce_scatter": 8}
    for name, pieces in expected.items():
        both = results[0]["sent"][name] + results[2]["sent"][name]
        assert pieces <= both / (PIECE * 4) < pieces * 1.02, f"{name}: {both / (PIECE * 4):.3f} pieces crossed"
    left = _namespaces()
    assert not any(n in left for n in names), f"namespaces left behind: {left}"


@needs_lab
def test_teardown_on_an_exception_and_on_sigterm():
    with pytest.raises(KeyError):
        with NodeLab(2, 100) as lab:
            lab.popen(1, ["sleep", "600"])
            raise KeyError("boom")
    assert lab.hub not in _namespaces()
    script = ("import sys, time; from fsdp_pass.testing.node_lab import NodeLab\n"
              "with NodeLab(2, 100) as lab:\n"
              "    lab.popen(0, ['sleep', '600'])\n"
              "    print(lab.hub, flush=True)\n"
              "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        hub = proc.stdout.readline().strip()
        assert hub in _namespaces()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert hub not in _namespaces()


def test_without_root_or_iproute2_it_says_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in unavailable()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(node_lab.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert "tc tool(s): install iproute2" in unavailable()
    with pytest.raises(RuntimeError, match="install iproute2"):
        NodeLab(2, 100).__enter__()
