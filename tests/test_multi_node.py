"""examples/train.py launched as a cluster launches it: 2 nodes × 2 processes, one ``torchrun`` agent per node,
the rendezvous across a 400 Mbit/s link between network namespaces ([Note: a node lab]), against one node
with 4 processes (docs/howto.md, "Train on several nodes")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_pass.testing.node_lab import NodeLab, unavailable
from fsdp_pass.testing.spawn import free_port
from fsdp_pass.testing.strict_script import strict_launch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train.py"
# bucket-size: several buckets, so that reshard_after_forward=k reshards some (the last stays gathered)
SMALL = ["--steps", "4", "--eval-every", "0", "--eval-batches", "1", "--dim", "64", "--layers", "2", "--heads", "4",
         "--seq-len", "64", "--global-batch", "8", "--bucket-size", "20000", "--compiler", "aot_eager",
         "--no-progress", "--sample-bytes", "0"]
LAB = unavailable()
LAUNCH_TIMEOUT_S = 240


def _env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def _losses(log_json: Path, proc_output: str) -> dict:
    assert log_json.exists(), f"rank 0 wrote no {log_json.name}:\n{proc_output[-6000:]}"
    return json.loads(log_json.read_text())


def _two_nodes(lab: NodeLab, args: list[str], log_json: Path) -> dict:
    """One torchrun agent per node; the c10d rendezvous is hosted by node 0's agent, across the link."""
    port = free_port()
    # both agents' ranks under the strict mode, one board per launch ([Note: NCCL's rules, enforced on CPU])
    script, strict_env = strict_launch(str(EXAMPLE), str(log_json.with_suffix(".strict")))
    procs = []
    for node in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{lab.address(0)}:{port}", "--rdzv-id", "lab",
                "--rdzv-conf", "join_timeout=120", "--local-addr", lab.address(node), "--max-restarts", "0",
                *script, *SMALL, *args, "--log-json", str(log_json)]
        procs.append(lab.popen(node, argv, env={**_env(), **strict_env}, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:  # the lab kills both agents and their ranks if one fails or the time runs out
        outputs.append(proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
        assert proc.returncode == 0, f"node agent exited with {proc.returncode}:\n{outputs[-1][-6000:]}"
    return _losses(log_json, "\n".join(outputs))


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.skipif(LAB is not None, reason=LAB or "")
def test_two_nodes_of_two_train_like_one_node_of_four(tmp_path):
    script, strict_env = strict_launch(str(EXAMPLE), str(tmp_path / "one.strict"))
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          *script, *SMALL, "--log-json", str(tmp_path / "one.json")],
                         env={**os.environ, **_env(), **strict_env}, cwd=ROOT, capture_output=True, text=True,
                         timeout=LAUNCH_TIMEOUT_S)
    reference = _losses(tmp_path / "one.json", one.stdout + one.stderr)
    assert reference["reshard_after_forward"] is True and reference["buckets"] > 1
    with NodeLab(2, 400) as lab:
        # gathers in backward within each node (k = torchrun's LOCAL_WORLD_SIZE); across the nodes the
        # collectives run in two levels ([Note: collectives in two levels across nodes])
        within = _two_nodes(lab, ["--reshard-within-node"], tmp_path / "within.json")
        # HSDP: sharded within each node, replicated across the two
        hsdp = _two_nodes(lab, ["--mesh", "node"], tmp_path / "hsdp.json")
    assert within["world_size"] == 4 and within["reshard_after_forward"] == 2
    # the reduce-scatter sums within each node first: another order than one ring's, fp32 rounding apart
    assert within["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert hsdp["mesh"] == [2, 2]
    # another reduction order (reduce-scatter in the node, all-reduce across): fp32 rounding apart
    assert hsdp["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
