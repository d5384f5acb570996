"""Run a function on N ranks in fresh processes, with a hard timeout: never a hang.

Each rank is a new process with one OpenMP/intra-op thread, joined into a process group (gloo by
default) through a ``file://`` rendezvous. Ranks are forked from a ``forkserver`` that imported torch
and fsdp_pass once ([Note: ranks forked from a preloaded server]). The parent watches every rank's result pipe and
exit together: the first rank that raises (or dies with a non-zero exit code) ends the run at once,
and the other ranks are killed, even while they wait in a collective that can no longer complete.
Every rank runs under the strict mode of :mod:`fsdp_pass.testing.strict` unless the caller turns it off
([Note: NCCL's rules, enforced on CPU]).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .inductor_cache import compile_each_graph_once
from .strict import Strict, StrictRank, report_stuck_ranks, strict_config

if TYPE_CHECKING:
    from .node_lab import NodeLab

__all__ = ["RankFailed", "Strict", "free_port", "run_distributed", "set_launcher_env"]

_OK, _ERROR = "ok", "error"

# [Note: ranks forked from a preloaded server]
# Importing torch, Dynamo and fsdp_pass costs a rank process about 3 CPU seconds; with ``spawn`` every
# rank of every run paid it, which was most of the test suite's time for the short multi-rank tests
# (a 4-rank run of an empty function: 5.6 s on 2 cores). A ``forkserver`` pays it once per parent
# process: the server imports these modules and starts no threads, and each rank is forked from it
# (0.1 s for the same run). Each rank is still a fresh process: nothing a run does (process groups,
# Dynamo caches, patches, the random state) reaches the next one, because the server itself never
# runs a rank's function. The environment a rank sees is the server's, taken when the first run
# started it; a rank sets what it needs (``set_launcher_env``) itself.
_PRELOADED = ["fsdp_pass", "fsdp_pass.testing.spawn", "torch._inductor.compile_fx"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOADED)  # read once, when the first run starts the server
    return ctx


class RankFailed(AssertionError):
    """Rank ``rank`` raised (``details`` is its traceback) or exited with a non-zero code."""

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.details = details


def _worker(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple, conn: Connection,
            pg_timeout: float, backend: str | None, pin_cores: bool, nice: int, lab: "NodeLab | None",
            strict: Strict | None) -> None:
    if lab is not None:  # first: before any thread or socket ([Note: a node lab])
        lab.enter(rank * lab.nodes // world_size)
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size // lab.nodes)
        os.environ["GROUP_RANK"] = str(rank * lab.nodes // world_size)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    compile_each_graph_once()  # [Note: one Inductor compile per graph across ranks]
    session = None
    sending = threading.Lock()  # the strict mode's watchdog may report too

    def fail_now(message: str) -> None:
        with sending:
            conn.send((_ERROR, message))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    try:
        if strict is not None:  # before the process group: it sets what the group is made with
            session = StrictRank(strict, rank, world_size, _board(init_file), pg_timeout)
            session.start_watchdog(fail_now)
        if pin_cores:
            cpus = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
        if nice:  # before the process group: gloo's threads inherit it
            os.nice(nice)
        if backend is not None:
            dist.init_process_group(
                backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                timeout=timedelta(seconds=pg_timeout),
            )
        result = fn(rank, world_size, *args)
        if session is not None:
            session.finish()  # raises StrictModeError when the ranks broke one of NCCL's rules
        with sending:
            conn.send((_OK, result))
    except BaseException as error:
        details = traceback.format_exc() + (session.explain(error) if session is not None else "")
        with sending:
            conn.send((_ERROR, details))
        raise
    finally:
        if session is not None:
            session.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    # The body passed and the group is gone. Skip interpreter finalization: on a loaded machine a
    # C++ thread left by gloo or Dynamo is sometimes still joinable there and aborts the process
    # ("terminate called without an active exception"), which would read as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _board(init_file: str) -> str:
    """The directory where the strict mode's ranks post what they compare, beside the rendezvous file."""
    return os.path.join(os.path.dirname(init_file), "strict")


def _supervise(procs: list, conns: list[Connection], timeout: float) -> list[Any]:
    """Each rank's result once all exited cleanly; raise on the first failure or at the deadline."""
    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * len(procs)
    unread = dict(enumerate(conns))  # ranks whose message (or end of pipe) has not been read
    running = dict(enumerate(procs))

    def read(rank: int) -> None:
        conn = unread.pop(rank)
        try:
            status, value = conn.recv()
        except EOFError:  # the rank left without a word (os._exit): its exit code decides
            return
        if status == _ERROR:
            raise RankFailed(rank, value)
        results[rank] = value

    while running:
        ready = wait([*unread.values(), *(p.sentinel for p in running.values())],
                     timeout=max(0.0, deadline - time.monotonic()))
        if not ready and time.monotonic() >= deadline:
            raise TimeoutError(f"ranks {sorted(running)} did not finish within {timeout} s")
        for rank in [r for r, conn in unread.items() if conn.poll()]:
            read(rank)
        for rank, proc in list(running.items()):
            if proc.exitcode is None:
                continue
            if rank in unread and unread[rank].poll():  # its traceback, if it sent one before exiting
                read(rank)
            del running[rank]
            if proc.exitcode != 0:
                raise RankFailed(rank, f"exited with code {proc.exitcode}")
    return results


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300,
                    pg_timeout: float = 60, backend: str | None = "gloo", pin_cores: bool = False,
                    nice: int = 0, lab: "NodeLab | None" = None, strict: bool | Strict = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return each rank's result.

    ``fn`` must be a module-level function and its arguments and return value picklable (they cross
    process boundaries). Each rank joins a ``backend`` process group first (``None``: no group) whose
    collectives time out after ``pg_timeout`` seconds; ``pin_cores`` pins rank ``r`` to the ``r``-th
    core this process may use (round robin); ``nice`` adds to each rank's scheduling niceness (negative:
    ahead of other work on shared cores, for timing; needs the privilege to raise priority).
    ``timeout`` bounds the whole run. With a node ``lab`` ([Note: a node lab]) the ranks are split over
    its nodes in consecutive blocks (``world_size`` a multiple of ``lab.nodes``), each rank runs in its
    node's namespace and sees ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` as ``torchrun`` sets them.

    ``strict`` holds the ranks to NCCL's rules ([Note: NCCL's rules, enforced on CPU]): every rank makes
    every process group in the same order, every collective matches across its group's ranks. A rank
    that breaks one fails with :class:`~fsdp_pass.testing.strict.StrictModeError` naming where. Only a
    test that breaks a rule on purpose passes ``False``, or a :class:`Strict` with that check off.

    Raises :class:`RankFailed` (an ``AssertionError``) with the rank's traceback as soon as one rank
    raises or exits with a non-zero code, and ``TimeoutError`` if ranks are still running at the
    deadline; either way the remaining ranks are killed. A rank that exits with code 0 without
    returning (``os._exit(0)``) counts as passed, with result ``None``.
    """
    if lab is not None and world_size % lab.nodes:
        raise ValueError(f"world_size={world_size} ranks do not split evenly over the lab's {lab.nodes} nodes")
    config = strict_config(strict)
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, init_file, fn, args, pipes[r][1], pg_timeout, backend, pin_cores, nice,
                              lab, config))
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            for _, send in pipes:
                send.close()  # the children hold the write ends: a dead child reads as end of pipe
            try:
                return _supervise(procs, [recv for recv, _ in pipes], timeout)
            except TimeoutError as late:
                stuck = report_stuck_ranks(_board(init_file), world_size) if config and config.fingerprints else ""
                if stuck:
                    raise TimeoutError(f"{late}\n{stuck}") from None
                raise
        finally:
            started = [p for p in procs if p.pid is not None]
            for p in started:
                if p.is_alive():
                    p.kill()
            for p in started:
                p.join()
            for recv, send in pipes:
                recv.close()
                send.close()


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for an ``env://`` rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_launcher_env(rank: int, world_size: int, port: int) -> None:
    """The environment ``torchrun`` gives rank ``rank``: frameworks that create their own process group
    (accelerate, Lightning, torchtitan) read it. Run the rank with ``run_distributed(..., backend=None)``."""
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
