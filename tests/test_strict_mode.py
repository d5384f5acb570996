"""The strict mode of the test kit ([Note: NCCL's rules, enforced on CPU] in fsdp_pass/testing/strict.py):
each check fails on a program that breaks its rule, naming where each rank broke it, and passes a
program that keeps the rules.

Each bad program is a few lines on 2 ranks; the run ends within seconds of the violation (spawn's
fail-fast), or at the group's short timeout when the mismatch leaves a collective waiting.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fsdp_pass.testing.spawn import RankFailed, run_distributed
from fsdp_pass.testing.strict import Strict, _Collective, _first_mismatch

HERE = "tests/test_strict_mode.py"


def _line(text: str) -> str:
    """``tests/test_strict_mode.py:<n>``: where ``text`` first appears in this file."""
    with open(__file__) as f:
        for n, line in enumerate(f, 1):
            if text in line:
                return f"{HERE}:{n}"
    raise AssertionError(f"{text!r} is not in this file")


# -- rule 2: every rank makes every group, in the same order -----------------------------------------

def _group_by_its_members_alone(rank: int, world: int) -> None:
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)  # the subset's group
    dist.barrier()


def _groups_in_different_orders(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    if rank == 0:
        dist.new_group([0, 1])  # rank 0's first
        init_device_mesh("cpu", (2,))
    else:
        init_device_mesh("cpu", (1, 2))  # rank 1's first: a mesh's dim-0 groups [0] and [1]
        dist.new_group([0, 1])


def _one_rank_makes_an_extra_group(rank: int, world: int) -> None:
    dist.new_group([0, 1])
    if rank == 1:
        dist.new_group([1])  # rank 1's extra group


def test_a_group_made_by_its_members_alone_fails_naming_its_call_site():
    with pytest.raises(RankFailed) as info:
        run_distributed(_group_by_its_members_alone, 2, timeout=120)
    message = str(info.value)
    assert info.value.rank == 0
    assert "StrictModeError: rank 0 made process group #0 of ranks [0] by its members alone" in message, message
    assert f"at {_line('the subset' + chr(39) + 's group')} in _group_by_its_members_alone" in message, message
    assert "ranks [1] of the default group take no part" in message


def test_groups_made_in_different_orders_fail_naming_both_call_sites():
    with pytest.raises(RankFailed) as info:
        run_distributed(_groups_in_different_orders, 2, timeout=120)
    message = str(info.value)
    assert "StrictModeError: process group #0 differs across ranks" in message, message
    first, second = _line("rank 0's first"), _line("rank 1's first")
    mine, other = (first, second) if info.value.rank == 0 else (second, first)
    # both sites named: the DeviceMesh's group is made inside torch, its call site is the test's line
    assert re.search(rf"made process group #0 of ranks \[[01](, 1)?\] at {mine} in _groups_in_different_orders", message), message
    assert re.search(rf"made group #0 of ranks \[[01](, 1)?\] at {other} in _groups_in_different_orders", message), message


def test_a_rank_that_makes_a_group_the_others_do_not_fails():
    with pytest.raises(RankFailed) as info:
        run_distributed(_one_rank_makes_an_extra_group, 2, timeout=120)
    message = str(info.value)
    assert info.value.rank == 1
    assert f"rank 1 made process group #1 of ranks [1] at {_line('extra group')}" in message, message
    assert "but rank 0 returned from its function after making 1 group(s), with no group #1" in message, message


def _mesh_and_groups_on_every_rank(rank: int, world: int) -> list[float]:
    """Keeps every rule: a 2-D mesh, a group of a subset made on every rank, collectives of every kind."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    pair = dist.new_group([0, 1])  # every rank calls, ranks 2 and 3 as non-members
    shard = mesh.get_group("shard")
    x = torch.full((4,), float(rank))
    gathered = funcol.all_gather_tensor(x, 0, shard)
    reduced = funcol.reduce_scatter_tensor(gathered, "sum", 0, mesh.get_group("replicate"))
    summed = funcol.all_reduce(reduced, "sum", mesh.get_group("replicate"))
    if rank in (0, 1):
        dist.all_reduce(summed, group=pair)
    sent = [rank + 1] * world  # an uneven all-to-all: rank r sends r + 1 elements to each, so shapes differ by rank
    received = [r + 1 for r in range(world)]
    exchanged = torch.empty(sum(received))
    dist.all_to_all_single(exchanged, torch.full((sum(sent),), float(rank)), received, sent)
    compiled = torch.compile(lambda t: funcol.all_reduce(t * 2, "sum", shard), backend="aot_eager")
    return compiled(summed).tolist() + exchanged.tolist()


def test_a_program_that_keeps_the_rules_passes():
    results = run_distributed(_mesh_and_groups_on_every_rank, 4, timeout=300)
    assert [r[-10:] for r in results] == [[0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]] * 4


def _fsdp_pass_on_two_nodes(rank: int, world: int) -> list[float]:
    """fsdp_pass's own groups: 4 ranks the launcher reports as 2 nodes of 2 (the two-level groups across
    and within the nodes), with ``reshard_after_forward=2`` (backward's node groups); one step."""
    import fsdp_pass  # noqa: F401  (the vescale backend)
    from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss

    os.environ["GROUP_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank // 2), "2"  # as torchrun sets them
    model = init_std(Llama(LlamaConfig(layers=1)))
    compiled = torch.compile(model, backend="vescale", options={
        "compiler": "aot_eager", "min_bucket_bytes": 0, "reshard_after_forward": 2})
    tokens = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = lm_loss(compiled(tokens), tokens)
    loss.backward()
    return [loss.item()]


def test_fsdp_pass_groups_on_two_nodes_keep_the_rules():
    """Until fsdp_pass made its node groups on every rank (commit 82b5d0d), the group check failed here:
    ``rank 3 made process group #0 of ranks [1, 3] by its members alone (use_local_synchronization=True)
    at fsdp_pass/buckets/launcher_nodes.py:76 in new_local_group <- fsdp_pass/buckets/node_collectives.py:207
    in two_level_group_name <- fsdp_pass/buckets/mesh.py:98 in bucket_group_name; ranks [0, 2] of the
    default group take no part`` (without the node variables: ``rank 0 made process group #0 of ranks
    [0, 1] by its members alone ... <- fsdp_pass/buckets/mesh.py:153 in _make_node_groups``). gloo ran
    both without a word."""
    losses = run_distributed(_fsdp_pass_on_two_nodes, 4, timeout=300)
    assert all(len(r) == 1 and torch.isfinite(torch.tensor(r[0])) for r in losses)


_SCRIPT = """
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    dist.new_group([0], use_local_synchronization=True)  # only rank 0 makes it
dist.barrier()
dist.destroy_process_group()
"""


def test_a_script_launched_by_torchrun_runs_under_the_strict_mode(tmp_path):
    """The tests that launch scripts as users do (torchrun) run them through testing/strict_script.py: a
    script that makes a group on some ranks only fails the launch with the strict mode's message."""
    import subprocess
    import sys

    from fsdp_pass.testing.strict_script import strict_launch

    (tmp_path / "bad.py").write_text(_SCRIPT)
    script, env = strict_launch(str(tmp_path / "bad.py"), str(tmp_path / "board"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launch = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "0", *script], cwd=root, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root, **env})
    assert launch.returncode != 0, launch.stdout + launch.stderr
    assert "StrictModeError: rank 0 made process group #0 of ranks [0] by its members alone" in launch.stderr, \
        launch.stderr[-4000:]
    assert "bad.py:6 in <module>" in launch.stderr, launch.stderr[-4000:]


# -- rule 3: every collective matches across its group --------------------------------------------

def _all_gather_of_another_dtype(rank: int, world: int) -> None:
    # the same bytes: gloo mixes them without a word (float32 1.0 arrives as int32 1065353216)
    x = torch.ones(2, dtype=torch.float32 if rank == 0 else torch.int32)
    funcol.all_gather_tensor(x, 0, dist.group.WORLD).tolist()  # the all-gather of another dtype


def _reduce_scatter_of_another_shape(rank: int, world: int) -> None:
    group = dist.new_group([0, 1])
    x = torch.ones(4) if rank == 0 else torch.ones(2, 2)  # as many elements, another shape
    funcol.reduce_scatter_tensor(x, "sum", 0, group).tolist()  # the reduce-scatter of another shape


def _all_reduce_against_all_gather(rank: int, world: int) -> None:
    group = dist.new_group([0, 1])
    if rank == 0:
        funcol.all_reduce(torch.ones(4), "sum", group).tolist()  # rank 0's collective
    else:
        funcol.all_gather_tensor(torch.ones(2), 0, group).tolist()  # rank 1's collective


@pytest.mark.parametrize("program, marker, mine, theirs", [
    # gloo runs a reduce-scatter as an all-reduce: the flight recorder names what ran
    (_all_gather_of_another_dtype, "the all-gather of another dtype", "all_gather of Float [2]", "all_gather of Int [2]"),
    (_reduce_scatter_of_another_shape, "the reduce-scatter of another shape", "all_reduce of Float [4]",
     "all_reduce of Float [2, 2]"),
])
def test_a_collective_that_differs_across_ranks_fails_naming_each_ranks_call(program, marker, mine, theirs):
    with pytest.raises(RankFailed) as info:
        run_distributed(program, 2, timeout=120)
    message = str(info.value)
    assert "StrictModeError: collective #1 on process group" in message and "differs across its ranks" in message, message
    site = _line(marker)
    assert f"rank 0: gloo:{mine} at {site} in {program.__name__}" in message, message
    assert f"rank 1: gloo:{theirs} at {site} in {program.__name__}" in message, message


def test_collectives_that_leave_each_other_waiting_fail_within_seconds_saying_what_differs():
    # gloo's own timeout does not end this one: both ranks would wait until the run's deadline
    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_distributed(_all_reduce_against_all_gather, 2, timeout=120, pg_timeout=120)
    message = str(info.value)
    assert "watchdog): collective #1 on process group" in message and "differs across its ranks" in message, message
    assert time.monotonic() - started < 60
    assert re.search(rf"rank 0: gloo:all_reduce of Float \[4\] at {_line(chr(114) + 'ank 0' + chr(39) + 's collective')}", message), message
    assert re.search(rf"rank 1: gloo:all_gather of Float \[2\] at {_line(chr(114) + 'ank 1' + chr(39) + 's collective')}", message), message


def _eager_all_reduce_of_another_shape(rank: int, world: int) -> None:
    dist.all_reduce(torch.ones(2 if rank == 0 else 3))


def test_detail_stops_a_mismatched_eager_collective_before_it_runs():
    with pytest.raises(RankFailed) as info:
        run_distributed(_eager_all_reduce_of_another_shape, 2, timeout=120, strict=Strict(detail=True))
    assert "Detected mismatch between collectives on ranks" in str(info.value)


# -- the comparison itself (no ranks) --------------------------------------------------------------

def _c(seq: int, record: int, op: str = "gloo:all_reduce", size: tuple = (2,), dtype: str = "Float",
       group: str = "0") -> _Collective:
    return _Collective(group, seq, op, (size,), (dtype,), record)


def _post(collectives: list[_Collective], wrapped: bool = False, groups: dict | None = None) -> dict:
    return {"groups": groups or {}, "collectives": collectives, "wrapped": wrapped}


def test_comparison_finds_a_difference_a_missing_collective_and_allows_uneven_all_to_all():
    same = [_c(1, 0), _c(2, 1)]
    assert _first_mismatch({0: _post(same), 1: _post(same)}, "0") is None
    differs = _first_mismatch({0: _post(same), 1: _post([_c(1, 0), _c(2, 1, size=(3,))])}, "0")
    assert differs[0] == "0" and differs[3] == "differs" and differs[2][1].sizes == ((3,),)
    missing = _first_mismatch({0: _post(same), 1: _post(same[:1])}, "0")
    assert missing[3] == "missing" and missing[2][1] is None and missing[2][0].seq == 2
    uneven = [_c(1, 0, op="gloo:all_to_all", size=(4,)), _c(1, 1, op="gloo:all_to_all", size=(6,))]
    assert _first_mismatch({0: _post(uneven[:1]), 1: _post(uneven[1:])}, "0") is None
    other_dtype = [_c(1, 0, op="gloo:all_to_all", size=(4,), dtype="Int")]
    assert _first_mismatch({0: _post(uneven[:1]), 1: _post(other_dtype)}, "0")[3] == "differs"
    rooted = _c(1, 0, op="gloo:scatter", size=(4, 11), dtype="Byte")  # scatter_object_list: the root's tensors only
    bare = _Collective("0", 1, "gloo:scatter", (), (), 0)
    assert _first_mismatch({0: _post([rooted]), 1: _post([bare])}, "0") is None
    assert _first_mismatch({0: _post([rooted]), 1: _post([_c(1, 0, op="gloo:gather")])}, "0")[3] == "differs"


def test_comparison_of_a_rank_whose_recorder_wrapped_starts_where_its_records_do():
    full = [_c(s, s) for s in range(1, 6)]
    kept = [_c(s, s) for s in range(3, 6)]  # its two oldest dropped
    assert _first_mismatch({0: _post(full), 1: _post(kept, wrapped=True)}, "0") is None
    assert _first_mismatch({0: _post(full), 1: _post(kept)}, "0")[3] == "missing"  # not wrapped: really missing


def test_comparison_follows_a_name_reused_by_a_new_group():
    # group "1" destroyed and made again: the second group's sequence restarts; the ranks agree on both
    two_lives = [_c(1, 0, group="1"), _c(2, 1, group="1"), _c(1, 2, group="1", size=(5,))]
    groups = {"1": (0, 1)}
    assert _first_mismatch({0: _post(two_lives, groups=groups), 1: _post(two_lives, groups=groups)}, "0") is None
    other = two_lives[:2] + [_c(1, 2, group="1", size=(6,))]
    assert _first_mismatch({0: _post(two_lives, groups=groups), 1: _post(other, groups=groups)}, "0")[3] == "differs"
    # a running rank's earlier post (before the second group) lines up with the first group, and lacks
    # nothing yet; once that rank has finished, the second group's collective is missing on it
    earlier = {0: _post(two_lives, groups=groups), 1: _post(two_lives[:2], groups=groups)}
    assert _first_mismatch(earlier, "0", final={0}) is None
    assert _first_mismatch(earlier, "0")[3] == "missing"
